/// \file
/// `event_scope`: one transport event as a scope, instead of a hand-written
/// `enter()` / `leave()` pair in every handler.
#pragma once

#include <gdr/protocol/engine/engine.hpp>

namespace gdr::detail::proto {

/// `e.enter()` when made, `e.leave()` when the scope ends (at its end or at
/// any return). `leave()` resumes what completed and may free an abandoned
/// engine whose transport is quiet: nothing may touch the transport after
/// the scope, so a handler makes it its outermost object and returns right
/// after it ends.
class event_scope {
 public:
  explicit event_scope(engine& e) noexcept : e_(e) { e_.enter(); }
  ~event_scope() { e_.leave(); }
  event_scope(const event_scope&) = delete;
  event_scope& operator=(const event_scope&) = delete;

 private:
  engine& e_;
};

}  // namespace gdr::detail::proto
