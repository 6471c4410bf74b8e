/// \file
/// The link between a pending operation's stop callbacks and its
/// scheduler, which drops them when it is destroyed first.
#pragma once


namespace gdr::detail {

/// The stop callbacks of one pending operation, as its scheduler knows them.
/// An operation whose stop callbacks post to its scheduler (`uring_awaitable`,
/// `cancellable`) links a hook into it while they are registered
/// (`scheduler::link_stop_hook`) and unlinks it when it destroys them
/// (`unlink_stop_hook`). A scheduler being destroyed calls `drop` on every
/// hook still linked, after unlinking it: `drop` destroys the operation's
/// callbacks (which waits for one running on another thread), so no later
/// stop request reaches the dead scheduler. Loop thread only.
struct stop_hook {
  void (*drop)(stop_hook* self) noexcept = nullptr;
  stop_hook* prev = nullptr;  // null: not linked
  stop_hook* next = nullptr;
};

/// Takes `h` off its scheduler's list if it is on one; touches only the
/// neighbours, so it is safe after the scheduler dropped `h` and is gone.
inline void unlink_stop_hook(stop_hook& h) noexcept {
  if (h.prev == nullptr) return;
  h.prev->next = h.next;
  h.next->prev = h.prev;
  h.prev = h.next = nullptr;
}

}  // namespace gdr::detail
