// A watchdog for test cases: ends the process with exit code 124 and a
// message naming the test case if it runs longer than `seconds`. No gdr test
// may hang, even when the code under test is broken. Include it as
// "tests/support/watchdog.hpp" (every gdr_test may).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cstring>

#include <doctest/doctest.h>

namespace gdr_test_support {

class watchdog {
 public:
  explicit watchdog(unsigned seconds) noexcept {
    if (const doctest::ContextOptions* o = doctest::getContextOptions(); o && o->currentTest)
      current_name() = o->currentTest->m_name;
    struct sigaction sa {};
    sa.sa_handler = [](int) {
      static const char msg[] = "watchdog: test case took too long (hang), aborting: ";
      [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof msg - 1);
      const char* name = current_name();
      n = ::write(2, name, std::strlen(name));
      n = ::write(2, "\n", 1);
      ::_exit(124);
    };
    ::sigaction(SIGALRM, &sa, nullptr);
    ::alarm(seconds);
  }
  ~watchdog() { ::alarm(0); }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

 private:
  // Written before the alarm is armed, read by the handler: a plain static.
  static const char*& current_name() noexcept {
    static const char* name = "?";
    return name;
  }
};

}  // namespace gdr_test_support
