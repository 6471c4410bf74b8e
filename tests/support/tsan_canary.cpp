// Deliberately buggy: must FAIL under --config=tsan (checks the config).
#include <doctest/doctest.h>

#include <thread>

TEST_CASE("a data race is caught under --config=tsan") {
  int counter = 0;
  std::thread t([&] { ++counter; });  // unsynchronised write ...
  ++counter;                          // ... racing with this one
  t.join();
  CHECK(counter >= 1);
}
