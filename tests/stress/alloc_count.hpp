// Counts the C++ heap allocations alive in the process (every form of
// operator new and delete is replaced in alloc_count.cpp), so that a stress
// run can say "the engines, their early messages and every other object
// the run made are gone" by comparing the count before and after.
#pragma once

namespace stress {

/// Objects allocated with operator new and not yet deleted.
long live_allocations() noexcept;

}  // namespace stress
