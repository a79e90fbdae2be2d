// The tile backends' own translation unit: whether the AMX path can run here (tiles.h's kernels in
// attention.cpp and weight_gradient.cpp check it; module.cpp exposes it to Python).
#include "tiles.h"

namespace vitrain_kernels {

// Whether the AMX path can run: the CPU has AMX-TILE and AMX-BF16, the extension was built with them,
// and Linux granted this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once).
bool amx_available() {
#if VITRAIN_AMX
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;                  // AMX-BF16, AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return available;
#else
  return false;
#endif
}

}  // namespace vitrain_kernels
