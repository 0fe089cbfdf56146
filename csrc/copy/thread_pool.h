// A small persistent thread pool for the CPU copy path. One job runs at a time; a caller that
// finds the pool busy (another Python thread is mid-copy) runs its job on its own thread instead
// of waiting, so concurrent pack/unpack calls never deadlock or serialise behind each other.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace awex::copy {

class ThreadPool {
 public:
  static ThreadPool& instance();
  ~ThreadPool();

  // Runs fn(task) for task in [0, tasks) on up to size() threads, the caller included, and
  // returns when all are done. Exceptions from tasks are rethrown on the caller.
  void run(int tasks, const std::function<void(int)>& fn);
  void resize(int threads);
  int size() const { return size_.load(); }

 private:
  ThreadPool();
  void stop_workers();
  void worker_loop();
  void drain();

  std::mutex job_mutex_;  // held by the caller for the whole job
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  std::atomic<int> size_{1};
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  std::atomic<int> next_{0};
  int finished_ = 0;  // workers done with the current generation
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace awex::copy
