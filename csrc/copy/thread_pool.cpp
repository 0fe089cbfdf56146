#include "copy/thread_pool.h"

#include <sched.h>

#include <algorithm>

namespace awex::copy {
namespace {
int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() { resize(available_cpus()); }

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  stopping_ = false;
}

void ThreadPool::resize(int threads) {
  threads = std::max(1, threads);
  std::lock_guard<std::mutex> job(job_mutex_);
  stop_workers();
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  size_.store(threads);
}

void ThreadPool::drain() {
  // Claims tasks until none are left; shared by workers and the caller.
  while (true) {
    const int task = next_.fetch_add(1);
    if (task >= tasks_) return;
    try {
      (*fn_)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    drain();
    {
      // Every worker reports every generation, so none can lag into the next job's state.
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_ == static_cast<int>(workers_.size())) done_.notify_all();
    }
  }
}

void ThreadPool::run(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 0) return;
  std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
  if (!job.owns_lock() || tasks == 1 || workers_.empty()) {
    for (int t = 0; t < tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_.store(0);
    error_ = nullptr;
    finished_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return finished_ == static_cast<int>(workers_.size()); });
    fn_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace awex::copy
