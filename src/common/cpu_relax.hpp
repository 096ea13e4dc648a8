// SPDX-License-Identifier: Apache-2.0
#pragma once
// The pause of a spin-wait, inline: tells the core that this thread is spinning (x86 PAUSE,
// AArch64 YIELD), which saves power and hands the core's resources to its sibling hyperthread.

namespace gradsync {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace gradsync
