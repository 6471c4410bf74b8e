/// \file
/// gdr's diagnostics: one place that formats and writes them.
///
/// gdr reports failures through `std::error_code`s and exceptions; a line
/// is written only for what no caller can be told: a connection that failed
/// inside the event loop (its operations fail with the code, the line says
/// why), work abandoned by a scheduler's teardown, memory freed under a
/// peer's access, a fatal CUDA error, and, when asked with `GDR_LOG`, the
/// path each endpoint decided on. Every line reads "gdr <component>:
/// message" and goes to the sink in one call, by default one `write` to
/// stderr, so lines from several threads never interleave.
///
///   GDR_LOG=path      also print every path decision at set-up
///   GDR_LOG=all       every topic
///
/// `gdr::set_log_sink` sends the lines elsewhere (a test, a job's logger).
#pragma once

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace gdr {

/// Receives each diagnostic line, without its newline. Any thread; must not
/// throw, and must not call into gdr.
using log_sink = void (*)(std::string_view line) noexcept;

namespace detail {

/// The default sink: the line and a newline to stderr in one write.
inline void stderr_sink(std::string_view line) noexcept {
  char buf[1024];
  const std::size_t n = line.size() < sizeof buf - 1 ? line.size() : sizeof buf - 1;
  for (std::size_t i = 0; i < n; ++i) buf[i] = line[i];
  buf[n] = '\n';
  // stderr is unbuffered: one fwrite is one write(2).
  std::fwrite(buf, 1, n + 1, stderr);
}

inline std::atomic<log_sink>& log_sink_slot() noexcept {
  static std::atomic<log_sink> sink{&stderr_sink};
  return sink;
}

/// `spec` (a `GDR_LOG` value) names `topic` or `all`. Topics are separated
/// by commas, spaces or colons: "path", "path,tcp", "all".
constexpr bool log_spec_names(std::string_view spec, std::string_view topic) noexcept {
  while (!spec.empty()) {
    const std::size_t end = spec.find_first_of(", :");
    const std::string_view word = spec.substr(0, end);
    if (word == topic || word == "all") return true;
    if (end == std::string_view::npos) break;
    spec.remove_prefix(end + 1);
  }
  return false;
}

/// Formats "gdr <component>: " and `fmt` (printf's rules) into one line, at
/// most 1 KiB (a longer one is cut, ending in "..."), and hands it to the
/// sink. Allocates nothing: safe on noexcept and failure paths.
[[gnu::format(printf, 2, 0)]] inline void vlog(const char* component, const char* fmt, std::va_list args) noexcept {
  char line[1024];
  int head = std::snprintf(line, sizeof line, "gdr %s: ", component);
  if (head < 0) return;
  std::size_t n = static_cast<std::size_t>(head) < sizeof line ? static_cast<std::size_t>(head) : sizeof line - 1;
  const int body = std::vsnprintf(line + n, sizeof line - n, fmt, args);
  if (body < 0) return;
  if (n + static_cast<std::size_t>(body) >= sizeof line) {
    n = sizeof line - 1;
    line[n - 3] = line[n - 2] = line[n - 1] = '.';
  } else {
    n += static_cast<std::size_t>(body);
  }
  log_sink_slot().load(std::memory_order_acquire)(std::string_view(line, n));
}

/// One diagnostic line from `component` ("verbs", "scheduler", "cuda", ...).
[[gnu::format(printf, 2, 3)]] inline void log(const char* component, const char* fmt, ...) noexcept {
  std::va_list args;
  va_start(args, fmt);
  vlog(component, fmt, args);
  va_end(args);
}

}  // namespace detail

/// Sends gdr's diagnostic lines to `sink` (null: back to stderr) and returns
/// the previous sink. Any thread; a line being written may still reach the
/// previous sink.
inline log_sink set_log_sink(log_sink sink) noexcept {
  return detail::log_sink_slot().exchange(sink != nullptr ? sink : &detail::stderr_sink, std::memory_order_acq_rel);
}

/// `GDR_LOG` names `topic` (or `all`). Reads the environment at each call:
/// a caller that asks often keeps the answer (`path_log_enabled` does, so
/// set `GDR_LOG` before the first endpoint is made). Thread-safe.
inline bool log_topic_enabled(std::string_view topic) noexcept {
  const char* spec = std::getenv("GDR_LOG");
  return spec != nullptr && detail::log_spec_names(spec, topic);
}

}  // namespace gdr
