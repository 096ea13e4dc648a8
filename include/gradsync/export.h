/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file export.h
 * @brief Symbol export and C linkage macros shared by every public header.
 */
#ifndef GRADSYNC_EXPORT_H
#define GRADSYNC_EXPORT_H

#if defined(GRADSYNC_STATIC)
#define GRADSYNC_API
#elif defined(_WIN32)
#if defined(GRADSYNC_BUILDING)
#define GRADSYNC_API __declspec(dllexport)
#else
#define GRADSYNC_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define GRADSYNC_API __attribute__((visibility("default")))
#else
#define GRADSYNC_API
#endif

#ifdef __cplusplus
#define GRADSYNC_BEGIN_DECL extern "C" {
#define GRADSYNC_END_DECL }
#else
#define GRADSYNC_BEGIN_DECL
#define GRADSYNC_END_DECL
#endif

#if defined(__GNUC__) || defined(__clang__)
#define GRADSYNC_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define GRADSYNC_DEPRECATED(msg)
#endif

#endif /* GRADSYNC_EXPORT_H */
