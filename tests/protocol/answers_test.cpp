// The engine's member objects that bound what a peer can make it keep:
// the answer budget (gdr/protocol/engine/answers.hpp) and the withdrawals
// (gdr/protocol/engine/withdrawals.hpp), each on its own, without a
// transport.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/protocol/engine/answers.hpp>
#include <gdr/protocol/engine/withdrawals.hpp>

namespace proto = gdr::detail::proto;

TEST_CASE("the answer budget refuses the peer's answers at its limit and makes room as they are written") {
  proto::answer_budget b(3);
  CHECK(b.limit() == 3);
  std::vector<proto::frame*> held;
  while (b.room()) {
    proto::frame* f = b.make();
    REQUIRE(f != nullptr);
    CHECK(f->own_answer);
    held.push_back(f);
  }
  CHECK(held.size() == 3);
  CHECK(b.held() == 3);
  CHECK(b.make() == nullptr);  // the peer's next request waits (its reader pauses)
  // An answer owed for a reason bounded elsewhere goes past the limit.
  proto::frame* owed = b.make_owed();
  REQUIRE(owed != nullptr);
  CHECK(b.held() == 4);
  CHECK(b.most() == 4);
  // Written: room again only once below the limit, and it says so once.
  CHECK(!b.release(*owed));
  CHECK(!b.room());
  CHECK(b.release(*held.back()));
  held.pop_back();
  CHECK(b.room());
  CHECK(!b.release(*held.back()));
  held.pop_back();
  CHECK(!b.release(*held.back()));
  held.pop_back();
  CHECK(b.held() == 0);
  CHECK(b.most() == 4);  // the high-water mark stays
}

TEST_CASE("the answer budget's limit is at least one") {
  proto::answer_budget b(0);
  CHECK(b.limit() == 1);
  proto::frame* f = b.make();
  REQUIRE(f != nullptr);
  CHECK(!b.room());
  CHECK(b.release(*f));
}

TEST_CASE("withdrawals recognise each late frame once") {
  proto::withdrawals w;
  REQUIRE(w.remember_token(7));
  CHECK(w.has_token(7));
  CHECK(w.forget_token(7));
  CHECK(!w.has_token(7));
  CHECK(!w.forget_token(7));  // a second late frame for it is not recognised
  REQUIRE(w.remember_answer(9));
  CHECK(w.forget_answer(9));
  CHECK(!w.forget_answer(9));
  // A segmented request: three answers to come for ids 10..14.
  REQUIRE(w.remember_range(10, 15, 3));
  CHECK(!w.forget_in_range(15));
  CHECK(w.forget_in_range(10));
  CHECK(w.forget_in_range(14));
  CHECK(w.forget_in_range(12));
  CHECK(!w.forget_in_range(11));  // all three came: the range is gone
}

TEST_CASE("withdrawn announcements are found by their send id until their answer takes them off") {
  proto::withdrawals w;
  auto* a = new proto::announcement;
  auto* b = new proto::announcement;
  CHECK(a->own_announcement);
  a->id = 1;
  b->id = 2;
  w.add(*a);
  w.add(*b);
  CHECK(w.announcements() == 2);
  CHECK(w.find(2) == b);
  CHECK(w.find(3) == nullptr);
  w.erase(*b);
  CHECK(w.find(2) == nullptr);  // the peer answers an announcement once
  delete b;
  CHECK(w.announcements() == 1);
  // The endpoint failed: the engine takes the rest off (and frees them).
  CHECK(w.pop() == a);
  CHECK(w.pop() == nullptr);
  delete a;
}

TEST_CASE("withdrawals free the announcements still listed when they go") {
  // (Under ASan this is the leak check; here it must simply not crash.)
  proto::withdrawals w;
  auto* a = new proto::announcement;
  a->id = 5;
  w.add(*a);
  CHECK(w.announcements() == 1);
}
