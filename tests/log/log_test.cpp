// gdr/log.hpp: every diagnostic line has one format, reaches the sink in one
// call, is cut (not overrun) when too long, and a sink set by the user
// receives the lines gdr writes from its own failure paths.
#include <gdr/log.hpp>

#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include <gdr/sched/scheduler.hpp>

namespace {

std::vector<std::string>& lines() {
  static std::vector<std::string> v;
  return v;
}
void keep(std::string_view line) noexcept { lines().emplace_back(line); }

struct sink_guard {
  gdr::log_sink old;
  sink_guard() : old(gdr::set_log_sink(&keep)) { lines().clear(); }
  ~sink_guard() { gdr::set_log_sink(old); }
};

}  // namespace

TEST_CASE("a line reads 'gdr <component>: message' and reaches the sink once, without its newline") {
  sink_guard g;
  gdr::detail::log("verbs", "%s: work completion failed: %s", "10.0.0.2:4791", "retry exceeded");
  REQUIRE(lines().size() == 1);
  CHECK(lines()[0] == "gdr verbs: 10.0.0.2:4791: work completion failed: retry exceeded");
}

TEST_CASE("a line longer than 1 KiB is cut and ends in '...'") {
  sink_guard g;
  const std::string big(3000, 'x');
  gdr::detail::log("memory", "%s", big.c_str());
  REQUIRE(lines().size() == 1);
  const std::string& l = lines()[0];
  CHECK(l.size() == 1023);
  CHECK(l.rfind("gdr memory: xxx", 0) == 0);
  CHECK(l.substr(l.size() - 3) == "...");
}

TEST_CASE("set_log_sink returns the previous sink; null restores stderr") {
  gdr::log_sink first = gdr::set_log_sink(&keep);
  const bool was_keep = gdr::set_log_sink(nullptr) == &keep;
  const bool was_stderr = gdr::set_log_sink(first) == &gdr::detail::stderr_sink;
  CHECK(was_keep);
  CHECK(was_stderr);
}

TEST_CASE("a scheduler's teardown that abandons work says so through the sink") {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  // A read on a pipe nobody writes: abandoned by the destructor.
  struct stuck_read : gdr::operation {
    char c = 0;
  } op;
  op.complete = [](gdr::operation*, int, std::uint32_t) noexcept {};
  {
    sink_guard g;
    {
      gdr::scheduler s({.teardown_timeout = std::chrono::milliseconds(50)});
      io_uring_sqe* sqe = s.get_sqe();
      REQUIRE(sqe != nullptr);
      io_uring_prep_read(sqe, p[0], &op.c, 1, 0);
      io_uring_sqe_set_data(sqe, static_cast<gdr::operation*>(&op));
      s.note_submitted();
      s.submit();
    }
    REQUIRE(lines().size() == 1);
    CHECK(lines()[0].rfind("gdr scheduler: destroyed with 1 operation(s) still in flight after 50 ms", 0) == 0);
  }
  ::close(p[0]);
  ::close(p[1]);
}

TEST_CASE("GDR_LOG topics: a word of the list, or all") {
  static_assert(gdr::detail::log_spec_names("path,verbs", "verbs"));
  static_assert(gdr::detail::log_spec_names("all", "anything"));
  static_assert(!gdr::detail::log_spec_names("pathverbs", "verbs"));
  CHECK(true);
}
