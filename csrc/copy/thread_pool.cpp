#include "copy/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace awex::copy {
namespace {
int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// A positive integer environment variable, or 0 when unset or not one.
int env_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return (*end == '\0' && v > 0 && v < (1 << 20)) ? static_cast<int>(v) : 0;
}

// AWEX_COPY_THREADS when set; otherwise this process's share of the CPUs it may run on. The
// ranks of one host each get their own pool, so a pool per rank as wide as the host puts
// LOCAL_WORLD_SIZE x CPUs threads on CPUs cores, and on a host where ranks outnumber cores that
// oversubscription cost 10-30 % of a sync (awex-fast bench, 4 ranks on 2 cores). A launcher that
// already pinned the process to its share (fewer CPUs in its affinity than the host has, as vLLM's
// CPU workers are) gets all of them.
int default_threads() {
  if (const int forced = env_count("AWEX_COPY_THREADS")) return forced;
  const int cpus = available_cpus();
  const int local_ranks = env_count("LOCAL_WORLD_SIZE");
  const int host = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (local_ranks > 1 && cpus >= host) return std::max(1, cpus / local_ranks);
  return cpus;
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() { resize(default_threads()); }

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

void ThreadPool::drain(Job& job) {
  // Claims tasks of this job until none are left; shared by workers and the caller.
  while (true) {
    const int task = job.next.fetch_add(1);
    if (task >= job.tasks) return;
    try {
      (*job.fn)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.mu);
      if (!job.error) job.error = std::current_exception();
    }
    if (job.done.fetch_add(1) + 1 == job.tasks) {
      std::lock_guard<std::mutex> lock(job.mu);
      job.finished.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
#if defined(__linux__)
  // A name profilers and `awex-fast bench --profile` can tell apart from the transport's threads.
  pthread_setname_np(pthread_self(), "awex_copy");
#endif
  uint64_t seen = 0;
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = current_;  // keeps the job alive even if the caller has moved on
    }
    if (job) drain(*job);
  }
}

void ThreadPool::run(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 0) return;
  std::unique_lock<std::mutex> exclusive(job_mutex_, std::try_to_lock);
  if (!exclusive.owns_lock() || tasks == 1 || workers_.empty()) {
    for (int t = 0; t < tasks; ++t) fn(t);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->tasks = tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = job;
    ++generation_;
  }
  wake_.notify_all();
  drain(*job);
  {
    std::unique_lock<std::mutex> lock(job->mu);
    job->finished.wait(lock, [&] { return job->done.load() == job->tasks; });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_.reset();
  }
  if (job->error) std::rethrow_exception(job->error);
}

}  // namespace awex::copy
