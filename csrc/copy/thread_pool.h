// A small persistent thread pool for the CPU copy path.
//
// A job is split into many small tasks that whichever threads are running claim one by one, so
// a descheduled thread (the norm when training and inference processes share a few cores)
// delays nothing: the caller takes part and the job ends when its last task is done, not when
// every worker has woken up. Each job has its own counters, so a worker that wakes late for an
// old job finds it exhausted and cannot touch the next one. One job runs at a time; a caller
// that finds the pool busy (another Python thread is mid-copy) runs its job on its own thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace awex::copy {

class ThreadPool {
 public:
  static ThreadPool& instance();
  ~ThreadPool();

  // Runs fn(task) for task in [0, tasks) on up to size() threads, the caller included, and
  // returns when all are done. The first exception thrown by a task is rethrown on the caller.
  void run(int tasks, const std::function<void(int)>& fn);
  void resize(int threads);
  int size() const { return size_.load(); }

 private:
  struct Job {
    const std::function<void(int)>* fn = nullptr;
    int tasks = 0;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    std::mutex mu;
    std::condition_variable finished;
    std::exception_ptr error;
  };

  ThreadPool();
  void stop_workers();
  void worker_loop();
  static void drain(Job& job);

  std::mutex job_mutex_;  // held by the caller for the whole job
  std::mutex mu_;         // guards current_, generation_, stopping_
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<int> size_{1};
  std::shared_ptr<Job> current_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace awex::copy
