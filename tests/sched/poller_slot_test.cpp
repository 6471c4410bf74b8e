// gdr/sched/scheduler.hpp, the poller slots: a scheduler holds at most one
// poller of each `poller_kind`, found with one load (`poller_slot<P>()`),
// as the CUDA event poller is found on every GPU await. (A file of its own
// beside scheduler_test.cpp: the slots are a separate concern of the header.)
#include <doctest/doctest.h>

#include <thread>

#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>

namespace {

// Stands for a poller of a higher layer. `cuda_events` is the only kind
// there is; the scheduler knows the kind, never the type behind it.
// `poller` is deliberately not at offset 0 (the first base is polymorphic
// too, so it is the primary base): the slot stores a `poller*`, and reading it
// back must adjust the pointer to the derived object.
struct padding {
  virtual ~padding() = default;
  long pad[3] = {1, 2, 3};
};
class fake_poller final : public padding, public gdr::poller {
 public:
  static constexpr gdr::poller_kind kind = gdr::poller_kind::cuda_events;
  gdr::poll_status poll() noexcept override { return {}; }
  const char* name() const noexcept override { return "fake"; }
};

class kindless_poller final : public gdr::poller {
 public:
  gdr::poll_status poll() noexcept override { return {}; }
  const char* name() const noexcept override { return "kindless"; }
};

struct not_a_poller {
  // Read only inside the concept's requires-expression, which clang's
  // unused-variable warning does not count.
  [[maybe_unused]] static constexpr gdr::poller_kind kind = gdr::poller_kind::cuda_events;
};

}  // namespace

static_assert(gdr::slotted_poller<fake_poller>);
static_assert(!gdr::slotted_poller<kindless_poller>, "a poller without a kind has no slot");
static_assert(!gdr::slotted_poller<not_a_poller>, "only pollers have slots");

TEST_CASE("a poller slot is empty until a poller claims it, and empty again once released") {
  gdr::scheduler s;
  fake_poller p;
  CHECK(s.poller_slot<fake_poller>() == nullptr);
  REQUIRE(s.claim_poller_slot(p));
  CHECK(s.poller_slot<fake_poller>() == &p);
  CHECK(s.poller_slot<fake_poller>()->pad[2] == 3);  // the derived object, not the poller base
  s.release_poller_slot(p);
  CHECK(s.poller_slot<fake_poller>() == nullptr);
}

TEST_CASE("a taken slot cannot be claimed by a second poller of the kind, nor released by it") {
  gdr::scheduler s;
  fake_poller first, second;
  REQUIRE(s.claim_poller_slot(first));
  CHECK_FALSE(s.claim_poller_slot(second));
  CHECK(s.poller_slot<fake_poller>() == &first);
  s.release_poller_slot(second);  // not the holder: nothing changes
  CHECK(s.poller_slot<fake_poller>() == &first);
  s.release_poller_slot(first);
  CHECK(s.claim_poller_slot(second));  // free again
  CHECK(s.poller_slot<fake_poller>() == &second);
  s.release_poller_slot(second);
}

TEST_CASE("each scheduler has slots of its own") {
  gdr::scheduler a, b;
  fake_poller pa, pb;
  REQUIRE(a.claim_poller_slot(pa));
  CHECK(b.poller_slot<fake_poller>() == nullptr);
  REQUIRE(b.claim_poller_slot(pb));
  CHECK(a.poller_slot<fake_poller>() == &pa);
  CHECK(b.poller_slot<fake_poller>() == &pb);
  a.release_poller_slot(pa);
  b.release_poller_slot(pb);
}

TEST_CASE("another thread finds the poller claimed on the scheduler's thread") {
  gdr::scheduler s;
  fake_poller p;
  REQUIRE(s.claim_poller_slot(p));
  fake_poller* seen = nullptr;
  long pad = 0;
  std::thread t([&] {
    seen = s.poller_slot<fake_poller>();
    if (seen != nullptr) pad = seen->pad[0];  // under TSan: ordered by the slot's acquire load
  });
  t.join();
  CHECK(seen == &p);
  CHECK(pad == 1);
  s.release_poller_slot(p);
}
