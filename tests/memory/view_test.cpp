// gdr::view<T, S>: the non-owning range. Host access is tested on Host and
// Pinned views (it does not compile for Device: tests/type_safety); the parts
// every space shares (sizes, subviews, bytes, the device ordinal) on all three.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <gdr/memory/view.hpp>

TEST_CASE_TEMPLATE("a host-accessible view reads and writes the memory it names", S, gdr::Host, gdr::Pinned) {
  std::vector<int> v(8);
  std::iota(v.begin(), v.end(), 1);
  gdr::view<int, S> view(v);
  CHECK(view.size() == 8);
  CHECK(view.size_bytes() == 8 * sizeof(int));
  CHECK(view[0] == 1);
  view[7] = 70;
  CHECK(v[7] == 70);
  int sum = 0;
  for (int x : view) sum += x;
  CHECK(sum == 1 + 2 + 3 + 4 + 5 + 6 + 7 + 70);
  std::span<int> s = view;
  CHECK(s.data() == v.data());
  CHECK(view.span().size() == 8);
  CHECK(view.device() == -1);
}

TEST_CASE_TEMPLATE("subview clamps to the view instead of running past it", S, gdr::Host, gdr::Pinned, gdr::Device) {
  std::array<int, 10> a{};
  gdr::view<int, S> v(a.data(), a.size());
  CHECK(v.subview(2, 3).size() == 3);
  CHECK(v.subview(2, 3).data() == a.data() + 2);
  CHECK(v.subview(8, 5).size() == 2);
  CHECK(v.subview(12, 1).size() == 0);
  CHECK(v.subview(12, 1).data() == a.data() + 10);
  CHECK(v.subview(4).size() == 6);
  CHECK(v.first(3).size() == 3);
  CHECK(v.first(30).size() == 10);
}

TEST_CASE("a Device view carries its device ordinal through subviews and byte views") {
  int fake[4] = {};
  gdr::view<int, gdr::Device> v(fake, 4, 3);
  CHECK(v.device() == 3);
  CHECK(v.subview(1, 2).device() == 3);
  CHECK(v.as_bytes().device() == 3);
  CHECK(v.as_bytes().size() == 4 * sizeof(int));
  gdr::view<const int, gdr::Device> c = v;
  CHECK(c.device() == 3);
  CHECK(c.data() == fake);
}

TEST_CASE("as_bytes keeps constness and covers every byte") {
  const std::array<std::uint32_t, 3> a{1, 2, 3};
  auto v = gdr::host_view(a);
  static_assert(std::is_same_v<decltype(v), gdr::view<const std::uint32_t, gdr::Host>>);
  auto b = gdr::as_bytes(v);
  static_assert(std::is_same_v<decltype(b), gdr::view<const std::byte, gdr::Host>>);
  CHECK(b.size() == 12);
  CHECK(static_cast<const void*>(b.data()) == static_cast<const void*>(a.data()));
}

TEST_CASE("a default view is empty") {
  gdr::view<double, gdr::Device> v;
  CHECK(v.empty());
  CHECK(v.data() == nullptr);
  CHECK(v.device() == -1);
}

TEST_CASE("a view deduced from a span is a Host view") {
  std::vector<float> f(3);
  gdr::view v{std::span<float>(f)};
  static_assert(std::is_same_v<decltype(v), gdr::view<float, gdr::Host>>);
  CHECK(v.size() == 3);
}
