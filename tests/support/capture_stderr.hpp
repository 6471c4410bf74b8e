// capture_stderr(f): everything written to file descriptor 2 while `f`
// runs, for tests of what gdr prints (path decisions, teardown warnings).
// Include it as "tests/support/capture_stderr.hpp" (every gdr_test may).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

#include <doctest/doctest.h>

namespace gdr_test_support {

template <class F>
std::string capture_stderr(F&& f) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(fds[1], 2);
  f();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  return out;
}

}  // namespace gdr_test_support
