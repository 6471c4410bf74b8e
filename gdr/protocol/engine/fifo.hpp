/// \file
/// The intrusive list every engine queue is made of.
#pragma once

#include <cassert>
#include <cstddef>

namespace gdr::detail::proto {

/// Doubly linked intrusive FIFO over `T::*Prev` / `T::*Next`.
template <class T, T* T::*Prev, T* T::*Next>
struct fifo {
  T* head = nullptr;
  T* tail = nullptr;
  std::size_t size = 0;

  bool empty() const noexcept { return head == nullptr; }
  void push_back(T* n) noexcept {
    n->*Prev = tail;
    n->*Next = nullptr;
    (tail ? tail->*Next : head) = n;
    tail = n;
    ++size;
  }
  void push_front(T* n) noexcept {
    n->*Prev = nullptr;
    n->*Next = head;
    (head ? head->*Prev : tail) = n;
    head = n;
    ++size;
  }
  /// Unlinks `n`, which must be on this list (an assertion: unlinking a
  /// node that is not would silently empty the list).
  void erase(T* n) noexcept {
    assert((n->*Prev != nullptr ? (n->*Prev)->*Next == n : head == n) && "gdr: fifo::erase of a node not on the list");
    (n->*Prev ? (n->*Prev)->*Next : head) = n->*Next;
    (n->*Next ? (n->*Next)->*Prev : tail) = n->*Prev;
    n->*Prev = n->*Next = nullptr;
    --size;
  }
  T* pop_front() noexcept {
    T* n = head;
    if (n != nullptr) erase(n);
    return n;
  }
};

}  // namespace gdr::detail::proto
