// Portable path: plain C++ over the packed layout; runs on any x86-64 (or any CPU).
#include "moe_generic.h"

namespace moelab {
IsaOps portable_ops() { return IsaOps{gemm_generic, quant_generic, act_generic, peak_generic<4>}; }
}  // namespace moelab
