// moelab fused MoE experts operator: routing, threading and ISA dispatch.
//
// out[t] = sum_k w[t,k] * down_e(act(gate_e x_t, up_e x_t)), e = ids[t,k]
//
// Stage 1 tasks are (expert, intermediate slice) pairs, largest experts first, pulled
// dynamically by OpenMP threads; each computes gate and up for all of that expert's
// tokens in one pass over the slice's weights and writes the activated h (in the
// stage-2 input format: fp32, bf16 (bf16 and fp8 weights) or int8 + group scales).
// Stage 2 tasks are output-row slices; each walks the active experts in a fixed order
// and accumulates router-weighted results straight into its slice of the output, so
// there are no races and the result does not depend on the thread count.
//
// Worker pool: a lane worker's calls run on the extension's pool (pool.h), any other thread's on
// its OpenMP team (libgomp keeps its threads alive between calls; see parallel()); either way each
// stage's tasks are claimed one at a time, so a skewed routing (one expert with most of the rows)
// is spread over all threads by its slices. Per-worker busy time per stage is kept for the benchmark's
// imbalance figure (last_call_stats).
#include <omp.h>
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>  // raise_probe(3) only
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "moe_kernels.h"
#include "pool.h"

namespace moelab {

// Errors are values at the boundary: the functions that take tensors (moe_forward, moe_submit,
// Prepared.forward / .submit, Ticket.wait) return the error's message as a string instead of
// throwing, and the Python wrapper (moelab.kernels.op) raises it. On torch 2.11 (its CUDA wheel,
// an AVX-512 machine, 2026-11-27) any exception leaving moe_forward killed the interpreter with SIGSEGV on every ISA
// path — a failing TORCH_CHECK and a plain std::runtime_error alike, thrown with the GIL held —
// while the same exception kinds thrown from a function without tensor arguments (_raise_probe)
// reached Python intact, and torch 2.13 raised in both cases (also under AddressSanitizer,
// clean). No exception crosses the tensor-taking bindings now.
//
// Messages are built without iostreams. On the same torch 2.11 box (2026-11-28) returning the
// message instead of throwing still died with SIGSEGV, before any output, for the messages that
// hold a number; the probes that passed formatted text only. Inserting an integer into a
// std::ostream goes through the locale's num_put facet, which this extension and torch's
// libraries can resolve to different copies of libstdc++ (pytorch/pytorch#81543 shows torch's
// libraries changing how every sstream formats numbers). std::to_chars uses no locale.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>>
void append(std::string& s, T v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  s.append(buf, r.ptr);
}
template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw std::runtime_error(message(args...));
}
// In prepare(): on failure, the message goes to `err` and prepare returns no job.
#define MOELAB_REQUIRE(cond, ...)                    \
  do {                                               \
    if (!(cond)) {                                   \
      err = ::moelab::message(__VA_ARGS__);          \
      return nullptr;                                \
    }                                                \
  } while (0)
namespace {

constexpr int kSlice2 = 64;  // output rows per stage-2 task

// Per-thread busy seconds of the calling Python thread's last call, per stage (for the
// benchmark's imbalance figure). thread_local: concurrent calls from Python threads each
// keep their own.
struct CallStats {
  std::vector<double> busy1, busy2;
  double wall1 = 0, wall2 = 0;
  int64_t tasks1 = 0, tasks2 = 0;
};
thread_local CallStats last_stats;

// A call's large buffers (activation panels, stage-1 outputs), kept by the calling thread for its
// next call and never zero-filled: every byte a kernel reads is written first (panel rows and
// bytes past a call's own are read into tile rows whose results are discarded). A prefill's
// buffers are tens of MB; allocating and zero-filling them each call (first-touch page faults and
// a one-thread memset) took 26.6-28.2 ms of a 2048-token bf16 layer (three calls, 2 cores,
// 2026-11-28). A buffer is given back when a call needs less than a quarter of it, so decode after
// prefill does not keep the prefill's memory.
class Reused {
 public:
  template <typename T>
  T* get(size_t n) {
    const size_t bytes = n * sizeof(T) + 64;
    if (bytes > cap_ || bytes < cap_ / 4) {
      mem_.reset();
      cap_ = 0;  // a failed allocation (std::bad_alloc, the call's error) leaves an empty buffer
      mem_.reset(new uint8_t[bytes]);  // default-initialised: no fill
      cap_ = bytes;
    }
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(mem_.get()) + 63) & ~uintptr_t(63));
  }

 private:
  std::unique_ptr<uint8_t[]> mem_;
  size_t cap_ = 0;
};
struct CallBuffers {
  Reused panel1, panel2, hf, hb, hq, hsx, hcorr, xq, xsx, xcorr;
};
thread_local CallBuffers call_buffers;

// Whether this thread is one of the extension's lane workers (set once by the worker).
thread_local bool on_lane = false;

// fn(task, worker) for every task in [0, n) on up to `threads` threads, tasks claimed one at a
// time (dynamic scheduling). A lane worker's calls run on the extension's pool (pool.h); any other
// thread's on its OpenMP team — torch's own threads run its operators there, and libgomp's idle
// team members poll after a region: a pool beside them found them holding the CPUs (a bench
// call right after a torch operator ran on one thread, half the read bandwidth), while a team per
// lane worker made libgomp throttle every team's polling (pool.h).
template <typename F>
void parallel(int64_t n, int threads, F&& fn) {
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (threads == 1) {
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
  } else if (on_lane) {
    WorkerPool::get().run(n, threads, fn);
  } else {  // an exception may not leave an OpenMP region (the process ends): kept, rethrown after it
    std::exception_ptr error;
    std::atomic<bool> failed{false};
    std::mutex m;
#pragma omp parallel num_threads(threads)
    {
      const int w = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < n; ++t) {
        if (failed.load(std::memory_order_relaxed)) continue;  // the rest are not run
        try {
          fn(t, w);
        } catch (...) {
          std::lock_guard<std::mutex> g(m);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
    }
    if (error) std::rethrow_exception(error);
  }
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}

IsaOps ops_for(int isa) {
  switch (isa) {
    case ISA_AMX: return amx_ops();
    case ISA_AVX512: return avx512_ops();
    case ISA_AVX512VNNI: return avx512vnni_ops();
    case ISA_AVX2: return avx2_ops();
    default: return portable_ops();
  }
}

size_t tile_bytes(int wtype, int kd) {
  switch (wtype) {
    case W_F32: return size_t(64) * kd;
    case W_BF16: return size_t(32) * kd;
    case W_INT8:
    case W_FP8: return size_t(16) * kd;
    default: return size_t(8) * kd;
  }
}

// One experts call, checked and ready to run: its inputs (kept alive by the job), the routing's
// pairs per expert after the expert map, and the output it writes.
struct Job {
  at::Tensor xc, w1, s1, b1, w2, s2, b2, out;
  std::vector<int64_t> ids;   // (T*K) the routing's expert ids, row-major
  std::vector<float> wts;     // (T*K) its weights in fp32
  int64_t K = 0;              // slots per token
  std::vector<int64_t> meta;
  double alpha = 0, limit = 0;
  std::vector<int32_t> cnt;   // pairs per (local) expert
  std::vector<int64_t> emap;  // empty: ids are local experts; else local = emap[id], -1 = not here
};

// The routing copied into the job as int64 ids and fp32 weights. The common dtypes (int64 / int32
// ids; fp32 / bf16 / fp16 weights, contiguous) are read directly: a decode step's call has a few
// slots, and two ATen conversions (dispatcher round trips, a tensor allocated for the weights)
// cost more than the kernel's own routing; any other dtype or layout goes through ATen once.
void copy_routing(const at::Tensor& ids, const at::Tensor& wts, Job& job) {
  const int64_t S = ids.numel();
  job.K = ids.dim() == 2 ? ids.size(1) : 0;
  job.ids.resize(size_t(S));
  job.wts.resize(size_t(S));
  if (ids.is_contiguous() && ids.scalar_type() == at::kLong) {
    std::memcpy(job.ids.data(), ids.data_ptr<int64_t>(), size_t(S) * sizeof(int64_t));
  } else if (ids.is_contiguous() && ids.scalar_type() == at::kInt) {
    const int32_t* p = ids.data_ptr<int32_t>();
    for (int64_t s = 0; s < S; ++s) job.ids[s] = p[s];
  } else {
    const at::Tensor c = ids.to(at::kLong).contiguous();
    std::memcpy(job.ids.data(), c.data_ptr<int64_t>(), size_t(S) * sizeof(int64_t));
  }
  if (wts.is_contiguous() && wts.scalar_type() == at::kFloat) {
    std::memcpy(job.wts.data(), wts.data_ptr<float>(), size_t(S) * sizeof(float));
  } else if (wts.is_contiguous() && wts.scalar_type() == at::kBFloat16) {
    const at::BFloat16* p = wts.data_ptr<at::BFloat16>();
    for (int64_t s = 0; s < S; ++s) job.wts[s] = float(p[s]);
  } else if (wts.is_contiguous() && wts.scalar_type() == at::kHalf) {
    const at::Half* p = wts.data_ptr<at::Half>();
    for (int64_t s = 0; s < S; ++s) job.wts[s] = float(p[s]);
  } else {
    const at::Tensor c = wts.to(at::kFloat).contiguous();
    std::memcpy(job.wts.data(), c.data_ptr<float>(), size_t(S) * sizeof(float));
  }
}

// meta: E, H, I, Kp1, Ip, Hp, wtype, group, act, isa, nthreads, slice1
// Checks everything (with the GIL held) and counts the pairs; on a failed check, no job and the
// message in `err` (MOELAB_REQUIRE, above).
// ``expert_map`` (vLLM's convention, optional): (R,) integers over the router's ids, -1 = the
// expert is not here (its slots contribute 0 and are not computed), else its local index.
std::shared_ptr<Job> prepare_job(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                             const at::Tensor& w1, const at::Tensor& s1, const at::Tensor& b1,
                             const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& b2,
                             std::vector<int64_t> meta, double alpha, double limit,
                             const std::optional<at::Tensor>& expert_map, std::string& err) {
  MOELAB_REQUIRE(meta.size() == 12, "moelab: meta must have 12 entries");
  const int E = int(meta[0]), H = int(meta[1]), Kp1 = int(meta[3]), Ip = int(meta[4]),
            Hp = int(meta[5]), wtype = int(meta[6]), group = int(meta[7]), S1 = int(meta[11]);
  MOELAB_REQUIRE(x.dim() == 2 && x.size(1) == H, "moelab: hidden states must be (T, ", H, ")");
  MOELAB_REQUIRE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moelab: hidden states must be float32 or bfloat16");
  MOELAB_REQUIRE(ids.dim() == 2 && ids.size(0) == x.size(0), "moelab: top_k_index must be (T, K)");
  MOELAB_REQUIRE(wts.sizes() == ids.sizes(), "moelab: top_k_weights must match top_k_index");
  MOELAB_REQUIRE(at::isIntegralType(ids.scalar_type(), /*includeBool=*/false),
                 "moelab: top_k_index must hold integer expert ids");
  MOELAB_REQUIRE(S1 % 16 == 0 && Ip % S1 == 0 && Hp % 16 == 0, "moelab: bad packed geometry");
  MOELAB_REQUIRE(wtype >= W_F32 && wtype <= W_FP8, "moelab: unknown weight type ", wtype);
  const bool is_int = wtype == W_INT8 || wtype == W_INT4;
  const bool is_fp8 = wtype == W_FP8;
  const bool has_scales = is_int || is_fp8;
  const size_t tb1 = tile_bytes(wtype, Kp1), tb2 = tile_bytes(wtype, Ip);
  const size_t e_bytes1 = tb1 * size_t(2 * Ip / 16), e_bytes2 = tb2 * size_t(Hp / 16);
  MOELAB_REQUIRE(w1.numel() == int64_t(e_bytes1) * E && w2.numel() == int64_t(e_bytes2) * E,
              "moelab: packed weight size does not match the layer geometry; repack the layer");
  MOELAB_REQUIRE(reinterpret_cast<uintptr_t>(w1.data_ptr()) % 64 == 0 &&
                  reinterpret_cast<uintptr_t>(w2.data_ptr()) % 64 == 0,
              "moelab: packed weights must be 64-byte aligned");
  if (has_scales) {
    MOELAB_REQUIRE(group > 0 && Kp1 % group == 0 && Ip % group == 0,
                "moelab: padded lengths must be multiples of the group/block length");
    const size_t lanes = is_int ? 16 : 1;
    const size_t st1 = size_t(Kp1 / group) * lanes, st2 = size_t(Ip / group) * lanes;
    MOELAB_REQUIRE(s1.scalar_type() == at::kFloat && s2.scalar_type() == at::kFloat &&
                    s1.numel() == int64_t(st1) * (2 * Ip / 16) * E &&
                    s2.numel() == int64_t(st2) * (Hp / 16) * E,
                "moelab: packed scales do not match the layer geometry; repack the layer");
  }
  auto job = std::make_shared<Job>();
  job->xc = x.contiguous();
  copy_routing(ids, wts, *job);
  job->w1 = w1; job->s1 = s1; job->b1 = b1; job->w2 = w2; job->s2 = s2; job->b2 = b2;
  job->meta = std::move(meta);
  job->alpha = alpha;
  job->limit = limit;
  job->out = at::empty({x.size(0), H}, x.options());
  if (expert_map.has_value() && expert_map->defined()) {
    MOELAB_REQUIRE(expert_map->dim() == 1, "moelab: expert_map must be one-dimensional");
    MOELAB_REQUIRE(at::isIntegralType(expert_map->scalar_type(), /*includeBool=*/false),
                   "moelab: expert_map must hold integers");
    // (a long contiguous map, the executors' own, is read as it is: no dispatch of .to())
    const bool as_is = expert_map->scalar_type() == at::kLong && expert_map->is_contiguous();
    const at::Tensor m = as_is ? *expert_map : expert_map->to(at::kLong).contiguous();
    const int64_t* mp = m.data_ptr<int64_t>();
    job->emap.assign(mp, mp + m.numel());
    for (int64_t v : job->emap)
      MOELAB_REQUIRE(v >= -1 && v < E, "moelab: expert_map entry ", v, " out of range [-1, ", E, ")");
  }
  const int64_t S = int64_t(job->ids.size());
  const int64_t* idp = job->ids.data();
  const float* wp = job->wts.data();
  const int64_t R = job->emap.empty() ? E : int64_t(job->emap.size());
  job->cnt.assign(E, 0);
  for (int64_t s = 0; s < S; ++s) {
    MOELAB_REQUIRE(idp[s] >= 0 && idp[s] < R, "moelab: expert id ", idp[s], " out of range [0, ", R, ")");
    const int64_t e = job->emap.empty() ? idp[s] : job->emap[idp[s]];
    if (e >= 0 && wp[s] != 0.0f) job->cnt[e]++;  // a slot of weight exactly 0 adds 0: not computed
  }
  return job;
}

// prepare_job, with what it allocates (contiguous copies, the output) failing as the call's error
// rather than as an exception through the binding (see the top of this file).
std::shared_ptr<Job> prepare(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                             const at::Tensor& w1, const at::Tensor& s1, const at::Tensor& b1,
                             const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& b2,
                             std::vector<int64_t> meta, double alpha, double limit,
                             const std::optional<at::Tensor>& expert_map, std::string& err) {
  try {
    return prepare_job(x, ids, wts, w1, s1, b1, w2, s2, b2, std::move(meta), alpha, limit, expert_map, err);
  } catch (const std::exception& e) {
    err = message("moelab: experts call failed: ", e.what());
    return nullptr;
  }
}

// Runs a prepared job without the GIL; throws nothing it can avoid (allocation aside).
void compute(Job& j) {
  const std::vector<int64_t>& meta = j.meta;
  const int E = int(meta[0]), H = int(meta[1]), Kp1 = int(meta[3]), Ip = int(meta[4]),
            Hp = int(meta[5]), wtype = int(meta[6]), group = int(meta[7]), act = int(meta[8]),
            isa = int(meta[9]), nthreads = std::max(1, int(meta[10])), S1 = int(meta[11]);
  const double alpha = j.alpha, limit = j.limit;
  const at::Tensor &xc = j.xc, &w1 = j.w1, &b1 = j.b1, &w2 = j.w2, &b2 = j.b2;
  const at::Tensor &s1 = j.s1, &s2 = j.s2;
  at::Tensor& out = j.out;
  const bool is_int = wtype == W_INT8 || wtype == W_INT4;
  const bool is_fp8 = wtype == W_FP8;
  const bool has_scales = is_int || is_fp8;
  const bool bf16_act = wtype == W_BF16 || is_fp8;  // fp8 weights meet bf16 activations
  // AVX2 and avx512vnni (no BF16) multiply bf16/fp8 weights in fp32: they read fp32 copies of
  // the (bf16-valued) activations, made once per call instead of once per task (fp8: times
  // kFp8XScale).
  const bool want_xf = bf16_act && (isa == ISA_AVX2 || isa == ISA_AVX512VNNI);
  const int offset = wtype == W_INT8 ? 128 : 8;
  const int64_t T = xc.size(0), K = j.K, S = T * K;
  if (T == 0) return;
  const size_t tb1 = tile_bytes(wtype, Kp1), tb2 = tile_bytes(wtype, Ip);
  const size_t e_bytes1 = tb1 * size_t(2 * Ip / 16), e_bytes2 = tb2 * size_t(Hp / 16);
  const int G1 = has_scales ? Kp1 / group : 0, G2 = has_scales ? Ip / group : 0;
  const size_t lanes = is_int ? 16 : 1;  // int: a scale per row; fp8: one per 16-row tile
  const size_t st1 = size_t(G1) * lanes, st2 = size_t(G2) * lanes;  // scale floats per tile
  const float* sc1 = has_scales ? s1.data_ptr<float>() : nullptr;
  const float* sc2 = has_scales ? s2.data_ptr<float>() : nullptr;
  const float* bias1 = b1.defined() && b1.numel() ? b1.data_ptr<float>() : nullptr;
  const float* bias2 = b2.defined() && b2.numel() ? b2.data_ptr<float>() : nullptr;
  const IsaOps ops = ops_for(isa);
  const at::Tensor& x = xc;

  // ---- routing: counting sort of the (token, slot) pairs by (local) expert ----
  const int64_t* idp = j.ids.data();
  const float* wp = j.wts.data();
  const std::vector<int32_t>& cnt = j.cnt;
  const bool mapped = !j.emap.empty();
  std::vector<int32_t> off(E + 1, 0), pair_tok(S), iota(S);
  std::vector<float> pair_w(S);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + cnt[e];
  {
    std::vector<int32_t> fill(off.begin(), off.end() - 1);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t e = mapped ? j.emap[idp[s]] : idp[s];
      if (e < 0 || wp[s] == 0.0f) continue;  // an expert not here, or weight 0 (padding): adds 0
      const int32_t p = fill[e]++;
      pair_tok[p] = int32_t(s / K);
      pair_w[p] = wp[s];
    }
  }
  for (int64_t s = 0; s < S; ++s) iota[s] = int32_t(s);

  // ---- stage-1 input in the kernel's format ----
  std::vector<float> xf;
  std::vector<uint16_t> xb;
  CallBuffers& bufs = call_buffers;
  ActView a1{};
  if (wtype == W_F32) {
    if (x.scalar_type() == at::kFloat) {
      a1.base = xc.data_ptr<float>();
    } else {
      xf.resize(size_t(T) * H);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr());
      for (size_t i = 0; i < xf.size(); ++i) {
        uint32_t u = uint32_t(src[i]) << 16;
        std::memcpy(&xf[i], &u, 4);
      }
      a1.base = xf.data();
    }
    a1.ld = size_t(H);
  } else if (bf16_act) {
    if (x.scalar_type() == at::kBFloat16 && Kp1 == H) {
      a1.base = xc.data_ptr();
    } else {
      xb.assign(size_t(T) * Kp1, 0);
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          const size_t i = size_t(t) * H + h;
          xb[size_t(t) * Kp1 + h] = x.scalar_type() == at::kFloat
                                        ? f32_to_bf16(xc.data_ptr<float>()[i])
                                        : reinterpret_cast<const uint16_t*>(xc.data_ptr())[i];
        }
      a1.base = xb.data();
    }
    a1.ld = size_t(Kp1);
    if (want_xf) {
      xf.assign(size_t(T) * Kp1, 0.0f);
      const uint16_t* src = static_cast<const uint16_t*>(a1.base);
      // a few rows (decode) convert on the calling thread: handing them out costs more than the work
      parallel(T, T >= 64 ? nthreads : 1, [&](int64_t t, int) {
        for (int k = 0; k < Kp1; ++k) {
          const uint32_t u = uint32_t(src[size_t(t) * Kp1 + k]) << 16;
          std::memcpy(&xf[size_t(t) * Kp1 + k], &u, 4);
          if (is_fp8) xf[size_t(t) * Kp1 + k] *= kFp8XScale;
        }
      });
      a1.xf = xf.data();
    }
  } else {
    int8_t* xq = bufs.xq.get<int8_t>(size_t(T) * Kp1);
    float* xsx = bufs.xsx.get<float>(size_t(T) * G1);
    int32_t* xcorr = bufs.xcorr.get<int32_t>(size_t(T) * G1);
    const bool in_f32 = x.scalar_type() == at::kFloat;
    const void* src = xc.data_ptr();
    // each row as fp32, zero-padded to Kp1, in a per-worker row buffer, then quantised
    const int nq = T >= 64 ? nthreads : 1;  // decode: on the calling thread
    std::vector<std::vector<float>> rows(size_t(std::min<int64_t>(nq, T)));
    for (std::vector<float>& row : rows) row.assign(size_t(Kp1), 0.0f);  // made here, not in the stage
    parallel(T, nq, [&](int64_t t, int w) {
      std::vector<float>& row = rows[size_t(w)];
      {
        if (in_f32) {
          std::memcpy(row.data(), static_cast<const float*>(src) + size_t(t) * H, sizeof(float) * H);
        } else {
          const uint16_t* r16 = static_cast<const uint16_t*>(src) + size_t(t) * H;
          for (int h = 0; h < H; ++h) {
            const uint32_t u = uint32_t(r16[h]) << 16;
            std::memcpy(&row[h], &u, 4);
          }
        }
        ops.quant(row.data(), Kp1, 1, Kp1, group, offset, xq + size_t(t) * Kp1, Kp1, xsx + size_t(t) * G1,
                  xcorr + size_t(t) * G1, G1);
      }
    });
    a1.base = xq;
    a1.ld = size_t(Kp1);
    a1.sx = xsx;
    a1.corr = xcorr;
    a1.ldg = size_t(G1);
  }

  // ---- AMX: an expert whose calls run on tiles gets its rows as A panels (amx_panel_at):
  // stage-1 rows gathered once per call (not per (expert, slice) task); bf16 stage-2 rows (h)
  // are written there by the stage-1 epilogue (a slice of S1 = 32 is one k-step) ----
  const bool amx = isa == ISA_AMX && wtype != W_F32 && amx_usable();
  const size_t esz = bf16_act ? 2 : 1, rb1 = size_t(Kp1) * esz, rb2 = size_t(Ip) * 2;
  std::vector<size_t> poff1(E + 1, 0), poff2(E + 1, 0);  // padded panel rows before expert e
  for (int e = 0; e < E; ++e) {
    poff1[e + 1] = poff1[e] + (amx && amx_tiles(wtype, Kp1, group, cnt[e]) ? amx_panel_rows(cnt[e]) : 0);
    poff2[e + 1] = poff2[e] + (amx && bf16_act && S1 == 32 && amx_tiles(wtype, Ip, group, cnt[e])
                                   ? amx_panel_rows(cnt[e]) : 0);
  }
  uint8_t* panel1 = bufs.panel1.get<uint8_t>(poff1[E] * amx_panel_row_bytes(rb1));
  uint8_t* panel2 = bufs.panel2.get<uint8_t>(poff2[E] * amx_panel_row_bytes(rb2));
  if (poff1[E] > 0) {
    const uint8_t* src = static_cast<const uint8_t*>(a1.base);
    parallel(E, nthreads, [&](int64_t e, int) {
      if (poff1[e + 1] == poff1[e]) return;
      uint8_t* pe = panel1 + poff1[e] * amx_panel_row_bytes(rb1);
      for (int j = 0; j < cnt[e]; ++j) {
        const uint8_t* row = src + size_t(pair_tok[off[e] + j]) * a1.ld * esz;
        for (size_t k = 0; k < rb1; k += 64) std::memcpy(pe + amx_panel_at(size_t(j), k, rb1), row + k, std::min<size_t>(64, rb1 - k));
      }
    });
  }

  // ---- stage-1 output (h) buffers, one row per pair ----
  float* hf = nullptr;
  uint16_t* hb = nullptr;
  int8_t* hq = nullptr;
  float* hsx = nullptr;
  int32_t* hcorr = nullptr;
  bool row_major2 = false;  // some expert's h goes to hb (not to an AMX panel)
  for (int e = 0; e < E; ++e) row_major2 = row_major2 || (cnt[e] > 0 && poff2[e + 1] == poff2[e]);
  if (wtype == W_F32 || want_xf) {
    hf = bufs.hf.get<float>(size_t(S) * Ip);
  } else if (bf16_act) {
    hb = bufs.hb.get<uint16_t>(row_major2 ? size_t(S) * Ip : 0);
  } else {
    hq = bufs.hq.get<int8_t>(size_t(S) * Ip);
    hsx = bufs.hsx.get<float>(size_t(S) * G2);
    hcorr = bufs.hcorr.get<int32_t>(size_t(S) * G2);
  }

  // ---- stage 1: (expert, slice) tasks, heaviest experts first ----
  std::vector<int> order;
  for (int e = 0; e < E; ++e) if (cnt[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cnt[a] > cnt[b]; });
  const int nsl1 = Ip / S1;
  const int64_t ntask1 = int64_t(order.size()) * nsl1;
  const int tiles1 = 2 * S1 / 16;
  std::vector<double> busy1(nthreads, 0.0), busy2(nthreads, 0.0);
  // per-worker scratch, sized on this thread before the stage runs (an allocation that fails
  // raises here; inside a parallel region it would end the process); stage 1's is freed before
  // stage 2's is made, so the two never add up
  int maxcnt = 0;
  for (int e = 0; e < E; ++e) maxcnt = std::max(maxcnt, cnt[e]);
  const int nw1 = int(std::min<int64_t>(nthreads, ntask1));
  const double t_start = omp_get_wtime();
  {
    std::vector<std::vector<float>> gus(size_t(std::max(nw1, 1))), hlocs(size_t(std::max(nw1, 1)));
    for (int w = 0; w < nw1; ++w) {
      gus[size_t(w)].resize(size_t(maxcnt) * 2 * S1);
      hlocs[size_t(w)].resize(size_t(maxcnt) * S1);
    }
    parallel(ntask1, nthreads, [&](int64_t task, int w) {
      std::vector<float>& gu = gus[size_t(w)];
      std::vector<float>& hloc = hlocs[size_t(w)];
      const double t0 = omp_get_wtime();
      const int e = order[task / nsl1], s = int(task % nsl1), n = cnt[e];
      MatView m{static_cast<const uint8_t*>(w1.data_ptr()) + size_t(e) * e_bytes1, tb1,
                has_scales ? sc1 + size_t(e) * (2 * Ip / 16) * st1 : nullptr, st1, Kp1, group,
                wtype};
      ActView a = a1;
      a.rows = pair_tok.data() + off[e];
      if (poff1[e + 1] > poff1[e]) a.panel = panel1 + poff1[e] * amx_panel_row_bytes(rb1);
      ops.gemm(m, s * tiles1, tiles1, a, n, gu.data(), size_t(2 * S1));
      const float* bb = bias1 ? bias1 + size_t(e) * 2 * Ip + size_t(s) * 2 * S1 : nullptr;
      ops.act(gu.data(), size_t(2 * S1), bb, n, S1, act, float(alpha), float(limit), hloc.data(), S1);
      for (int j = 0; j < n; ++j) {
        const size_t p = size_t(off[e] + j);
        const float* src = hloc.data() + size_t(j) * S1;
        if (wtype == W_F32) {
          std::memcpy(&hf[p * Ip + size_t(s) * S1], src, sizeof(float) * S1);
        } else if (want_xf) {  // bf16-rounded values kept as fp32
          float* dst = &hf[p * Ip + size_t(s) * S1];
          for (int i = 0; i < S1; ++i) {
            const uint32_t u = uint32_t(f32_to_bf16(src[i])) << 16;
            std::memcpy(&dst[i], &u, 4);
            if (is_fp8) dst[i] *= kFp8XScale;
          }
        } else if (poff2[e + 1] > poff2[e]) {  // AMX panel: slice s is k-step s
          uint8_t* dst = panel2 + poff2[e] * rb2 + amx_panel_at(size_t(j), size_t(s) * S1 * 2, rb2);
          for (int i = 0; i < S1; ++i) {
            const uint16_t v = f32_to_bf16(src[i]);
            std::memcpy(dst + 2 * i, &v, 2);
          }
        } else if (bf16_act) {
          uint16_t* dst = &hb[p * Ip + size_t(s) * S1];
          for (int i = 0; i < S1; ++i) dst[i] = f32_to_bf16(src[i]);
        } else {
          const size_t g0 = size_t(s) * (S1 / group);
          ops.quant(src, S1, 1, S1, group, offset, &hq[p * Ip + size_t(s) * S1], S1,
                    &hsx[p * G2 + g0], &hcorr[p * G2 + g0], G2);
        }
      }
      busy1[size_t(w)] += omp_get_wtime() - t0;
    });
  }
  const double t_mid = omp_get_wtime();

  // ---- stage 2: output-row slices, experts in fixed order, fused weighted sum ----
  ActView a2{};
  a2.ld = size_t(Ip);
  if (wtype == W_F32) a2.base = hf;
  else if (want_xf) a2.base = a2.xf = hf;
  else if (bf16_act) a2.base = hb;
  else { a2.base = hq; a2.sx = hsx; a2.corr = hcorr; a2.ldg = size_t(G2); }
  const bool out_f32 = x.scalar_type() == at::kFloat;
  float* outf = out_f32 ? out.data_ptr<float>() : nullptr;
  uint16_t* outb = out_f32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
  const int tiles_h = Hp / 16;
  const int nsl2 = (tiles_h * 16 + kSlice2 - 1) / kSlice2;
  {
    const int nw2 = int(std::min<int64_t>(nthreads, nsl2));
    std::vector<std::vector<float>> ys(size_t(std::max(nw2, 1))), accs(size_t(std::max(nw2, 1)));
    for (int w = 0; w < nw2; ++w) {
      ys[size_t(w)].resize(size_t(maxcnt) * kSlice2);
      accs[size_t(w)].resize(size_t(T) * kSlice2);
    }
    parallel(nsl2, nthreads, [&](int64_t s, int w) {
      std::vector<float>& y = ys[size_t(w)];
      std::vector<float>& acc = accs[size_t(w)];
      const double t0 = omp_get_wtime();
      const int tile0 = s * (kSlice2 / 16);
      const int nt = std::min(kSlice2 / 16, tiles_h - tile0);
      const int r0 = tile0 * 16, rows = nt * 16;
      std::fill_n(acc.begin(), size_t(T) * rows, 0.0f);
      for (int e = 0; e < E; ++e) {
        const int n = cnt[e];
        if (n == 0) continue;
        MatView m{static_cast<const uint8_t*>(w2.data_ptr()) + size_t(e) * e_bytes2, tb2,
                  has_scales ? sc2 + size_t(e) * (Hp / 16) * st2 : nullptr, st2, Ip, group,
                  wtype};
        ActView a = a2;
        a.rows = iota.data() + off[e];
        if (poff2[e + 1] > poff2[e]) a.panel = panel2 + poff2[e] * rb2;
        ops.gemm(m, tile0, nt, a, n, y.data(), size_t(rows));
        const float* bb = bias2 ? bias2 + size_t(e) * Hp + r0 : nullptr;
        for (int j = 0; j < n; ++j) {
          const int p = off[e] + j;
          const float wgt = pair_w[p];
          float* dst = acc.data() + size_t(pair_tok[p]) * rows;
          const float* src = y.data() + size_t(j) * rows;
          if (bb) for (int r = 0; r < rows; ++r) dst[r] += wgt * (src[r] + bb[r]);
          else for (int r = 0; r < rows; ++r) dst[r] += wgt * src[r];
        }
      }
      const int r1 = std::min(r0 + rows, H);
      for (int64_t t = 0; t < T; ++t) {
        const float* src = acc.data() + size_t(t) * rows;
        if (out_f32) std::memcpy(outf + size_t(t) * H + r0, src, sizeof(float) * (r1 - r0));
        else for (int r = r0; r < r1; ++r) outb[size_t(t) * H + r] = f32_to_bf16(src[r - r0]);
      }
      busy2[size_t(w)] += omp_get_wtime() - t0;
    });
  }
  last_stats.busy1 = std::move(busy1);
  last_stats.busy2 = std::move(busy2);
  last_stats.wall1 = t_mid - t_start;
  last_stats.wall2 = omp_get_wtime() - t_mid;
  last_stats.tasks1 = ntask1;
  last_stats.tasks2 = nsl2;
}

}  // namespace

// The output, or the message of the check that failed (see MOELAB_REQUIRE).
std::variant<at::Tensor, std::string> moe_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                                                  const at::Tensor& w1, const at::Tensor& s1, const at::Tensor& b1,
                                                  const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& b2,
                                                  std::vector<int64_t> meta, double alpha, double limit,
                                                  const std::optional<at::Tensor>& expert_map) {
  // Every check runs with the GIL held (prepare); the GIL is released for the compute only, and
  // reacquired before returning.
  std::string err;
  auto job = prepare(x, ids, wts, w1, s1, b1, w2, s2, b2, std::move(meta), alpha, limit, expert_map, err);
  if (!job) return err;
  std::string failed;
  {
    pybind11::gil_scoped_release nogil;
    try {  // allocation outside the parallel regions (panels, buffers) can fail for a huge call
      compute(*job);
    } catch (const std::exception& e) {
      failed = message("moelab: experts call failed: ", e.what());
    }
  }
  if (!failed.empty()) return failed;
  return job->out;
}

// ---- asynchronous calls: a host lane without the interpreter ----
//
// moe_submit checks and prepares a call on the calling (Python) thread, then hands it to a
// C++ worker thread of the given lane, which runs it without the GIL; the returned Ticket's
// wait() blocks (GIL released) until it is done and returns the output. Each lane is one
// worker thread with a FIFO queue (condition variable), started on first use and never
// stopped (it sleeps on its queue, after polling it for spin_ns(); a process exit ends it); its
// call's parallel work runs on the shared pool. Tensors are released by wait(), on the Python
// thread, never by the worker.
struct Ticket {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> done{false};  // set under m (for cv); read without it while polling
  std::string error;
  std::shared_ptr<Job> job;
  int64_t t_submit_ns = 0, t_start_ns = 0, t_end_ns = 0;
};

namespace {

struct LaneWorker {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Ticket>> q;
  std::atomic<int64_t> queued{0};  // q.size(), read without the lock while polling
  bool sleeping = false;           // under m: the worker waits on cv (a push must notify)

  LaneWorker() { std::thread([this] { loop(); }).detach(); }

  void push(std::shared_ptr<Ticket> t) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(m);
      q.push_back(std::move(t));
      queued.fetch_add(1, std::memory_order_release);
      wake = sleeping;
    }
    if (wake) cv.notify_one();  // a polling worker sees `queued` and needs no system call
  }

  void loop() {
    on_lane = true;  // this thread's kernel calls run on the pool (parallel)
    for (;;) {
      // poll (yielding: a thread ready to run on this CPU runs at once) before sleeping (pool.h)
      poll_for([this] { return queued.load(std::memory_order_acquire) != 0; });
      std::shared_ptr<Ticket> t;
      {
        std::unique_lock<std::mutex> g(m);
        while (q.empty()) {
          sleeping = true;
          cv.wait(g);
          sleeping = false;
        }
        t = std::move(q.front());
        q.pop_front();
        queued.fetch_sub(1, std::memory_order_relaxed);
      }
      std::string err;
      const int64_t t0 = monotonic_ns();
      try {
        compute(*t->job);
      } catch (const std::exception& e) {
        err = e.what();
      } catch (...) {
        err = "unknown error";
      }
      const int64_t t1 = monotonic_ns();
      {
        std::lock_guard<std::mutex> g(t->m);
        t->t_start_ns = t0;
        t->t_end_ns = t1;
        t->error = std::move(err);
        t->done = true;
      }
      t->cv.notify_all();
    }
  }
};

constexpr int kMaxLanes = 8;
std::mutex lanes_mu;
LaneWorker* lane_workers[kMaxLanes] = {};

LaneWorker& lane_worker(int lane) {
  std::lock_guard<std::mutex> g(lanes_mu);
  if (!lane_workers[lane]) lane_workers[lane] = new LaneWorker();  // never freed: outlives exit
  return *lane_workers[lane];
}

}  // namespace

// The extension's polling time (spin_ns in pool.h), microseconds: read, or set for every lane.
int64_t get_lane_spin_us() { return spin_ns() / 1000; }
void set_lane_spin_us(int64_t us) {
  if (us < 0) fail("moelab: lane spin ", us, " us is negative; give 0 (sleep at once) or more");  // no tensors: a throw is safe
  set_spin_us(us);
}

// The queued call's ticket, or the message of the check that failed (see MOELAB_REQUIRE).
std::variant<std::shared_ptr<Ticket>, std::string> moe_submit(
    const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w1, const at::Tensor& s1,
    const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& b2, std::vector<int64_t> meta,
    double alpha, double limit, const std::optional<at::Tensor>& expert_map, int64_t lane) {
  if (lane < 0 || lane >= kMaxLanes) return message("moelab: lane ", lane, " out of range [0, ", kMaxLanes, ")");
  std::string err;
  auto t = std::make_shared<Ticket>();
  t->job = prepare(x, ids, wts, w1, s1, b1, w2, s2, b2, std::move(meta), alpha, limit, expert_map, err);
  if (!t->job) return err;
  t->t_submit_ns = monotonic_ns();
  // with the GIL held: the queue's lock is held only for a push or a pop (the worker never takes
  // the GIL), while releasing the GIL and taking it back can wait for another Python thread
  lane_worker(int(lane)).push(t);
  return t;
}

// The call's output, or its error's message (an error on the lane, or a result already taken).
std::variant<at::Tensor, std::string> ticket_wait(Ticket& t) {
  {
    pybind11::gil_scoped_release nogil;
    // the caller waits for the result it needs next: poll for the lane's spin time first (a
    // worker's notify wakes a sleeping thread, and on an idle CPU that wake-up is slow), yielding
    // so a thread ready to run on this CPU does
    poll_for([&t] { return t.done.load(std::memory_order_acquire); });
    std::unique_lock<std::mutex> g(t.m);
    t.cv.wait(g, [&t] { return t.done.load(std::memory_order_relaxed); });
  }
  if (!t.job) return std::string("moelab: this ticket's result was already taken");
  at::Tensor out = t.job->out;
  t.job.reset();  // the inputs are released here, with the GIL held
  if (!t.error.empty()) return "moelab: experts call failed on its lane: " + t.error;
  return out;
}

// One layer's packed weights and meta row, held on the C++ side (moelab.kernels.op.prepared_call): its
// calls pass only what changes call after call (hidden states, routing, expert map), not the nine
// arguments that stay the same, each of which the binding converts on every call (on the
// development VM the binding's conversions cost more than the checks and the queueing together
// between a forward's layers). The checks are the unprepared calls' own: every call goes through
// moe_forward / moe_submit.
struct Prepared {
  at::Tensor w1, s1, b1, w2, s2, b2;
  std::vector<int64_t> meta;
  double alpha = 0, limit = 0;

  std::variant<at::Tensor, std::string> forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                                                const std::optional<at::Tensor>& expert_map) const {
    return moe_forward(x, ids, wts, w1, s1, b1, w2, s2, b2, meta, alpha, limit, expert_map);
  }
  std::variant<std::shared_ptr<Ticket>, std::string> submit(const at::Tensor& x, const at::Tensor& ids,
                                                            const at::Tensor& wts,
                                                            const std::optional<at::Tensor>& expert_map,
                                                            int64_t lane) const {
    return moe_submit(x, ids, wts, w1, s1, b1, w2, s2, b2, meta, alpha, limit, expert_map, lane);
  }
};

// Measured fp32 FMA peak of `isa` on nthreads threads, GFLOP/s (best of 3 runs of ~0.1 s).
double fma_peak_gflops(int64_t isa, int64_t nthreads) {
  if (isa < ISA_PORTABLE || isa > ISA_AVX512VNNI) fail("moelab: unknown isa code ", isa);  // no tensors here: a throw is safe
  const IsaOps ops = ops_for(int(isa));
  const int nt = std::max<int>(1, int(nthreads));
  pybind11::gil_scoped_release nogil;
  auto run = [&](int64_t iters, double& dt) {
    double flops = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nt) reduction(+ : flops)
    flops += ops.peak(iters);
    dt = omp_get_wtime() - t0;
    return flops;
  };
  int64_t iters = 1 << 14;
  double dt = 0, flops = run(iters, dt);
  while (dt < 0.05 && iters < (int64_t(1) << 40)) flops = run(iters *= 4, dt);  // grow until timeable
  double best = flops / dt / 1e9;
  for (int rep = 0; rep < 2; ++rep) {
    flops = run(iters, dt);
    best = std::max(best, flops / dt / 1e9);
  }
  return best;
}

// The calling thread's last moe_forward: wall seconds and per-thread busy seconds per stage.
std::map<std::string, std::vector<double>> last_call_stats() {
  const CallStats& s = last_stats;
  return {{"wall", {s.wall1, s.wall2}}, {"busy1", s.busy1}, {"busy2", s.busy2},
          {"tasks", {double(s.tasks1), double(s.tasks2)}}};
}

// Throws one kind of C++ exception (0: a failing TORCH_CHECK, i.e. c10::Error; 1: std::runtime_error,
// what fail() throws; 2: pybind11::value_error) from a function without tensor arguments, to see which
// ones a torch release carries back to Python (tests/test_kernels_errors.py; see MOELAB_REQUIRE).
// 3: a std::runtime_error whose message has an integer inserted by a std::ostringstream, the way
// message() used to build them (see append above): a diagnostic for a torch build, not a path moelab uses.
void raise_probe(int64_t kind) {
  if (kind == 0) TORCH_CHECK(false, "moelab: probe c10::Error");
  if (kind == 1) fail("moelab: probe std::runtime_error");
  if (kind == 2) throw pybind11::value_error("moelab: probe pybind11::value_error");
  if (kind == 3) {
    std::ostringstream os;
    os << "moelab: probe ostream integer " << kind;
    throw std::runtime_error(os.str());
  }
  if (kind == 4 || kind == 5) {  // a task of a parallel stage throws: 4 on an OpenMP team, 5 on the lanes' pool
    auto task = [](int64_t t, int) {
      if (t == 3) fail("moelab: probe exception in a parallel task");
    };
    if (kind == 4) parallel(16, 4, task);
    else WorkerPool::get().run(16, 4, task);
  }
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> f;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) f.push_back("avx2");
  if (__builtin_cpu_supports("fma")) f.push_back("fma");
  if (__builtin_cpu_supports("f16c")) f.push_back("f16c");  // part of the avx2 path's target
  if (__builtin_cpu_supports("avx512f")) f.push_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) f.push_back("avx512bw");
  if (__builtin_cpu_supports("avx512vl")) f.push_back("avx512vl");
  if (__builtin_cpu_supports("avx512dq")) f.push_back("avx512dq");
  if (__builtin_cpu_supports("avx512vnni")) f.push_back("avx512vnni");
  if (__builtin_cpu_supports("avx512bf16")) f.push_back("avx512bf16");
  if (__builtin_cpu_supports("avx512vbmi")) f.push_back("avx512vbmi");  // the fp8 decode's byte tables
  if (amx_usable()) {  // CPUID's AMX-TILE, -BF16 and -INT8, and the kernel's permission for this process
    f.push_back("amx_tile");
    f.push_back("amx_bf16");
    f.push_back("amx_int8");
  }
  return f;
}

void register_fastcalls(PyObject* module);  // fastcall.cpp
PyObject* params_key_of(PyObject* params);   // fastcall.cpp

namespace {

// submit_prepared(prepared, key, params, x, ids, wts, expert_map, lane) -> Ticket | str | None:
// Prepared.submit as a METH_FASTCALL function (moelab.kernels.backend.KernelBackend.submit's
// per-layer path), with the checks the Python side made before each call: the module's
// parameters still have the prepared call's key (params_key), every tensor is on the CPU and the
// hidden states are float32 or bfloat16. None where one fails, before anything was queued (the
// caller then prepares the call again, or runs the full checks); a str where the extension's own
// checks refuse the call (as Prepared.submit).
PyObject* submit_prepared(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // (a C++ exception here becomes a Python error, as through pybind11)
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "submit_prepared takes 8 positional arguments");
    return nullptr;
  }
  PyObject* now = params_key_of(args[2]);
  if (now == nullptr) return nullptr;
  const int same = PyObject_RichCompareBool(now, args[1], Py_EQ);
  Py_DECREF(now);
  if (same != 1) {
    if (same < 0) PyErr_Clear();
    Py_RETURN_NONE;
  }
  for (int i = 3; i < 6; ++i)
    if (!THPVariable_Check(args[i]) || !THPVariable_Unpack(args[i]).device().is_cpu()) Py_RETURN_NONE;
  std::optional<at::Tensor> expert_map;
  if (args[6] != Py_None) {
    if (!THPVariable_Check(args[6]) || !THPVariable_Unpack(args[6]).device().is_cpu()) Py_RETURN_NONE;
    expert_map = THPVariable_Unpack(args[6]);
  }
  const at::Tensor& x = THPVariable_Unpack(args[3]);
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) Py_RETURN_NONE;
  const int64_t lane = PyLong_AsLongLong(args[7]);
  if (lane == -1 && PyErr_Occurred()) return nullptr;
  const Prepared* prepared = nullptr;
  try {
    prepared = &pybind11::handle(args[0]).cast<const Prepared&>();
  } catch (const pybind11::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "submit_prepared: the first argument is not a Prepared call");
    return nullptr;
  }
  auto r = prepared->submit(x, THPVariable_Unpack(args[4]), THPVariable_Unpack(args[5]), expert_map, lane);
  if (auto* err = std::get_if<std::string>(&r))
    return PyUnicode_FromStringAndSize(err->data(), static_cast<Py_ssize_t>(err->size()));
  return pybind11::cast(std::get<std::shared_ptr<Ticket>>(r)).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef submit_methods[] = {
    {"submit_prepared", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(submit_prepared)),
     METH_FASTCALL, "Prepared.submit with the per-call checks, as a fast call: a Ticket, an error's message, or None"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

}  // namespace moelab

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moelab fused MoE expert kernels (CPU)";
  m.def("moe_forward", &moelab::moe_forward, "fused MoE experts forward (releases the GIL after its checks)",
        pybind11::arg("x"), pybind11::arg("ids"), pybind11::arg("wts"), pybind11::arg("w1"), pybind11::arg("s1"),
        pybind11::arg("b1"), pybind11::arg("w2"), pybind11::arg("s2"), pybind11::arg("b2"), pybind11::arg("meta"),
        pybind11::arg("alpha"), pybind11::arg("limit"), pybind11::arg("expert_map") = pybind11::none());
  pybind11::class_<moelab::Ticket, std::shared_ptr<moelab::Ticket>>(m, "Ticket")
      .def("wait", &moelab::ticket_wait, "block (GIL released) until the call ran; its output")
      .def("done", [](moelab::Ticket& t) { return t.done.load(std::memory_order_acquire); })
      .def("times_ns", [](moelab::Ticket& t) {
        std::lock_guard<std::mutex> g(t.m);
        return std::vector<int64_t>{t.t_submit_ns, t.t_start_ns, t.t_end_ns};
      }, "(submitted, started, ended) on CLOCK_MONOTONIC ns (time.perf_counter_ns's clock)");
  m.def("moe_submit", &moelab::moe_submit,
        "queue a fused MoE experts call on a C++ lane worker thread; returns a Ticket",
        pybind11::arg("x"), pybind11::arg("ids"), pybind11::arg("wts"), pybind11::arg("w1"), pybind11::arg("s1"),
        pybind11::arg("b1"), pybind11::arg("w2"), pybind11::arg("s2"), pybind11::arg("b2"), pybind11::arg("meta"),
        pybind11::arg("alpha"), pybind11::arg("limit"), pybind11::arg("expert_map") = pybind11::none(),
        pybind11::arg("lane") = 0);
  pybind11::class_<moelab::Prepared, std::shared_ptr<moelab::Prepared>>(m, "Prepared")
      .def(pybind11::init([](at::Tensor w1, at::Tensor s1, at::Tensor b1, at::Tensor w2, at::Tensor s2, at::Tensor b2,
                             std::vector<int64_t> meta, double alpha, double limit) {
             return std::make_shared<moelab::Prepared>(
                 moelab::Prepared{w1, s1, b1, w2, s2, b2, std::move(meta), alpha, limit});
           }),
           "a layer's call tail (w1, s1, b1, w2, s2, b2, meta, alpha, limit), kept for its calls")
      .def("forward", &moelab::Prepared::forward, "moe_forward on this tail (positional: x, ids, wts, expert_map)")
      .def("submit", &moelab::Prepared::submit,
           "moe_submit on this tail (positional: x, ids, wts, expert_map, lane); a Ticket");
  m.def("get_lane_spin_us", &moelab::get_lane_spin_us, "how long an idle lane worker polls its queue before it sleeps (us)");
  m.def("set_lane_spin_us", &moelab::set_lane_spin_us, "set how long idle lane workers poll their queues (us)");
  m.def("fma_peak_gflops", &moelab::fma_peak_gflops, "measured fp32 FMA peak of an ISA path (GFLOP/s)");
  m.def("last_call_stats", &moelab::last_call_stats,
        "this thread's last moe_forward: stage wall seconds, per-thread busy seconds, task counts");
  m.def("cpu_features", &moelab::cpu_features, "x86 features detected at run time");
  m.def("_raise_probe", &moelab::raise_probe, "throw one kind of C++ exception (0 c10::Error, 1 runtime_error, "
        "2 pybind11 value_error, 3 runtime_error formatted by an ostringstream, 4 / 5 runtime_error from a task of "
        "a parallel stage on an OpenMP team / the lanes' pool): which survive this torch");
  moelab::register_fastcalls(m.ptr());  // plan_entry, params_key: METH_FASTCALL functions, not pybind11 ones
  PyModule_AddFunctions(m.ptr(), moelab::submit_methods);  // submit_prepared (after Ticket's registration)
  m.attr("ABI_VERSION") = 8;  // 4: expert_map, moe_submit/Ticket (C++ lane workers); 5: errors as returned
                             // strings; 6: Prepared (a layer's call tail kept in C++); 7: plan_entry;
                             // 8: the lanes' pool, get/set_lane_spin_us, _raise_probe 4 and 5
}
