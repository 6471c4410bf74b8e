/// \file
/// Build configuration of gdr: 0/1 feature macros, tested with `#if` so that
/// `-Wundef` catches a misspelt name.
///
/// The build system sets them (Bazel: `//gdr:cuda` defines `GDR_HAS_CUDA=1`,
/// `//gdr:verbs` defines `GDR_HAS_VERBS=1`). A translation unit that sees neither
/// gets the portable core only. Every translation unit of one program must see the
/// same values: the headers are inline code, and differing values would be an ODR
/// violation.
#pragma once

#ifndef GDR_HAS_CUDA
#define GDR_HAS_CUDA 0
#endif

#ifndef GDR_HAS_VERBS
#define GDR_HAS_VERBS 0
#endif

#if GDR_HAS_CUDA != 0 && GDR_HAS_CUDA != 1
#error "GDR_HAS_CUDA must be 0 or 1"
#endif
#if GDR_HAS_VERBS != 0 && GDR_HAS_VERBS != 1
#error "GDR_HAS_VERBS must be 0 or 1"
#endif

#if !defined(__cpp_impl_coroutine) || __cplusplus < 202002L
#error "gdr needs C++20 with coroutines (-std=c++20)"
#endif

/// 1 when built under ThreadSanitizer (gcc's -fsanitize=thread defines
/// __SANITIZE_THREAD__; clang answers __has_feature).
#if defined(__SANITIZE_THREAD__)
#define GDR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GDR_TSAN 1
#endif
#endif
#ifndef GDR_TSAN
#define GDR_TSAN 0
#endif

#if defined(__GNUC__)
#define GDR_LIKELY(x) __builtin_expect(!!(x), 1)
#define GDR_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define GDR_LIKELY(x) (x)
#define GDR_UNLIKELY(x) (x)
#endif
