// What one stress run found and did: the failures (a short kind, such as
// "order" or "hang", and a sentence), the run's logical clock (a tick per
// operation start, completion and event, so that "the peer had closed
// before this failed" can be checked), and the optional log that
// `--seed S --log` prints while the run goes.
#pragma once

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace stress {

struct failure {
  std::string kind;  ///< one word, the same for the same defect: what the runner groups by
  std::string text;
};

class journal {
 public:
  explicit journal(bool log) : log_(log), start_(std::chrono::steady_clock::now()) {}

  /// The next tick of the run's logical clock.
  std::uint64_t tick() noexcept { return ++tick_; }
  std::uint64_t now_tick() const noexcept { return tick_; }
  /// Microseconds since the run began (for logs and bounds, never for decisions).
  std::int64_t micros() const noexcept {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count();
  }

  void fail(const std::string& kind, const std::string& text) {
    if (failures_.size() < 200) failures_.push_back({kind, text});
    if (log_) std::fprintf(stderr, "[%9lld us] FAIL %s: %s\n", static_cast<long long>(micros()), kind.c_str(),
                           text.c_str());
  }
  const std::vector<failure>& failures() const noexcept { return failures_; }
  bool ok() const noexcept { return failures_.empty(); }

  bool logging() const noexcept { return log_; }
  [[gnu::format(printf, 2, 3)]] void log(const char* fmt, ...) const {
    if (!log_) return;
    std::fprintf(stderr, "[%9lld us] ", static_cast<long long>(micros()));
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fputc('\n', stderr);
  }

 private:
  bool log_;
  std::chrono::steady_clock::time_point start_;
  std::uint64_t tick_ = 0;
  std::vector<failure> failures_;
};

/// printf into a std::string.
[[gnu::format(printf, 1, 2)]] inline std::string strf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list again;
  va_copy(again, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s;
  if (n > 0) {
    s.resize(static_cast<std::size_t>(n) + 1);
    std::vsnprintf(s.data(), s.size(), fmt, again);
    s.resize(static_cast<std::size_t>(n));
  }
  va_end(again);
  return s;
}

}  // namespace stress
