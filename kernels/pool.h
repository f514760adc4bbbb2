// The CPU worker pool the extension's lane workers run their kernel calls' parallel work on
// (issue #28: one pool for CPU expert tasks, used by the hybrid runtime's C++ lanes).
//
// Why not OpenMP's teams there: libgomp gives every thread that opens a parallel region a team of
// its own, and once the process holds more OpenMP threads than CPUs it makes every team's idle
// threads sleep almost at once ("throttled" polling). The hybrid executor's lane workers run
// kernels beside the control thread, whose torch operators use torch's own OpenMP team: with a
// lane's team alive, each of the control thread's parallel regions woke a sleeping thread, and a
// tiny decoder layer took 1.4-1.8 ms instead of 0.44 (the 2-vCPU development VM, 2026-11-30).
// An OpenMP region also ends at a barrier that waits for every team member, awake or not. (Calls
// from any other thread stay on that thread's OpenMP team: after a torch operator its members
// poll, holding the CPUs a pool's workers would need; moe_op.cpp's parallel().)
//
// Here a call is a job of n tasks: the calling thread runs tasks itself while up to `threads - 1`
// pool workers join; each task is claimed from an atomic counter (dynamic scheduling: a skewed
// routing spreads over whoever is there), and the caller waits only for tasks a worker actually
// took, never for a worker to wake. Concurrent callers (two lane workers) share the workers. Idle
// workers poll for new jobs for spin_ns() (yielding the CPU to any thread ready to run there),
// then sleep until a job arrives.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace moelab {

// CLOCK_MONOTONIC: the clock of Python's time.perf_counter_ns on Linux (a lane call's times_ns)
inline int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// How long an idle thread of the extension (a lane worker, a pool worker, a caller waiting for a
// queued call) polls before it sleeps, in nanoseconds: MOELAB_LANE_SPIN_US (read once), or
// set_spin_us; 0 (the default) sleeps at once. Waking a sleeping thread is a futex system call on
// the waking side, and where the sleeper's CPU has gone idle that CPU must be woken too: on the
// 2-vCPU development VM a submit to a lane worker idle for 5 ms took ~96 us against ~11 us to one
// still polling, and with OpenMP teams polling lanes cut the control thread's cost per MoE layer
// from 171-181 to 109-122 us. With this pool the same VM's decode step took 3.6-3.8 ms without
// polling and 7-9 ms with 5 ms of it (two lane workers and a pool worker polling beside the control
// thread on two CPUs): polling pays only where spare cores are (KTransformers' CPU workers poll).
constexpr int64_t kDefaultSpinUs = 0;        // moelab.kernels.op.DEFAULT_LANE_SPIN_US
constexpr int64_t kMaxSpinUs = 1000 * 1000;  // moelab.kernels.op.MAX_LANE_SPIN_US
inline std::atomic<int64_t> spin_ns_{-1};  // -1: not read yet

inline int64_t spin_ns() {
  int64_t v = spin_ns_.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  int64_t us = kDefaultSpinUs;
  if (const char* e = std::getenv("MOELAB_LANE_SPIN_US")) {
    char* end = nullptr;
    const long long p = std::strtoll(e, &end, 10);
    if (end != e && *end == '\0' && p >= 0 && p <= kMaxSpinUs) us = p;  // else the default (Python names bad values)
  }
  int64_t expected = -1;
  spin_ns_.compare_exchange_strong(expected, us * 1000);
  return spin_ns_.load(std::memory_order_relaxed);
}

inline void set_spin_us(int64_t us) { spin_ns_.store(std::min(us, kMaxSpinUs) * 1000, std::memory_order_relaxed); }

// Poll `ready()` (yielding) for spin_ns(); true if it became true meanwhile.
template <typename F>
bool poll_for(F&& ready) {
  if (ready()) return true;
  const int64_t spin = spin_ns();
  if (spin <= 0) return false;
  const int64_t until = monotonic_ns() + spin;
  while (monotonic_ns() < until) {
    if (ready()) return true;
    std::this_thread::yield();
  }
  return ready();
}

class WorkerPool {
 public:
  // fn(task, worker) for every task in [0, n), on the calling thread (worker 0) and up to
  // `threads - 1` pool workers (1 .. threads - 1, each index used by one thread at a time).
  // Returns when every task has run; rethrows the first exception a task threw.
  template <typename F>
  void run(int64_t n, int threads, F&& fn) {
    if (n <= 0) return;
    threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
    if (threads == 1) {
      for (int64_t t = 0; t < n; ++t) fn(t, 0);
      return;
    }
    Job job;
    job.n = n;
    job.slots = threads - 1;
    job.call = [](void* f, int64_t t, int w) { (*static_cast<std::remove_reference_t<F>*>(f))(t, w); };
    job.fn = static_cast<void*>(&fn);
    ensure(threads - 1);
    {
      std::lock_guard<std::mutex> g(m_);
      jobs_.push_back(&job);
      epoch_.fetch_add(1, std::memory_order_release);
      if (sleeping_ > 0) cv_.notify_all();
    }
    job.work(0);
    {
      std::lock_guard<std::mutex> g(m_);  // no worker joins after this
      jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
    }
    while (job.helpers.load(std::memory_order_acquire) > 0) std::this_thread::yield();  // tasks they took
    if (job.error) std::rethrow_exception(job.error);
  }

  static WorkerPool& get() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: its threads outlive static destructors
    return *pool;
  }

 private:
  struct Job {
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    int slots = 0;                  // under the pool's lock: workers that may still join
    std::atomic<int> helpers{0};    // workers that joined and have not finished
    void (*call)(void*, int64_t, int) = nullptr;
    void* fn = nullptr;
    std::exception_ptr error;       // the first task's exception (under err_m)
    std::mutex err_m;

    void work(int w) {
      for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        try {
          call(fn, t, w);
        } catch (...) {
          std::lock_guard<std::mutex> g(err_m);
          if (!error) error = std::current_exception();
          next.store(n, std::memory_order_relaxed);  // the rest are not run
        }
      }
    }
  };

  void ensure(int workers) {
    if (started_.load(std::memory_order_acquire) >= workers) return;
    std::lock_guard<std::mutex> g(start_m_);
    for (int i = started_.load(); i < workers; ++i) {
      std::thread([this] { loop(); }).detach();
      started_.fetch_add(1, std::memory_order_release);
    }
  }

  // A job with room for one more worker (taking its slot), else nullptr; under m_.
  Job* claim(int& w) {
    for (Job* j : jobs_) {
      if (j->slots > 0 && j->next.load(std::memory_order_relaxed) < j->n) {
        w = j->slots--;
        j->helpers.fetch_add(1, std::memory_order_acq_rel);
        return j;
      }
    }
    return nullptr;
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job* job = nullptr;
      int w = 0;
      poll_for([&] { return epoch_.load(std::memory_order_acquire) != seen; });
      {
        std::unique_lock<std::mutex> g(m_);
        for (;;) {
          seen = epoch_.load(std::memory_order_acquire);
          if ((job = claim(w)) != nullptr) break;
          ++sleeping_;
          cv_.wait(g, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
          --sleeping_;
        }
      }
      job->work(w);
      job->helpers.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex m_, start_m_;
  std::condition_variable cv_;
  std::vector<Job*> jobs_;
  std::atomic<uint64_t> epoch_{0};  // bumped per job: a polling worker looks for work
  int sleeping_ = 0;                // under m_
  std::atomic<int> started_{0};
};

}  // namespace moelab
