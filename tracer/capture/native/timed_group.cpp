// TimedGroup: a process group for DDP's reducer that forwards every collective to the
// real group and stamps each all-reduce's launch and completion, without the GIL.
//
// DDP's reducer launches a bucket's all-reduce from the autograd thread through
// process_group_->allreduce (its default communication "hook" is C++). Installed with
// Reducer::update_process_group, this wrapper sees every bucket while DDP keeps its fused
// divide-while-copying path (no Python hook is registered, so none turns it off).
//
// Times are CLOCK_MONOTONIC nanoseconds, the clock of Python's time.perf_counter_ns on
// Linux, so they sit on the same axis as the tracer's Python stamps. Launch is stamped
// before the call into the real group, completion in a callback on the returned Work's
// future (gloo: when the collective is done; NCCL: the future completes when the kernel
// is done on the stream, see cuda events in the Python side for device time).
//
// ReadyTimes stamps each parameter's gradient-ready time with a post hook inserted at
// the front of its AccumulateGrad node: it runs when the gradient is accumulated,
// before DDP's own hook on that node (which may launch the bucket), on the autograd
// thread, without the GIL.
//
// Records go into a preallocated array (no allocation on the hot path); take() hands
// them over and starts again. Each completion callback holds the array too, so one that
// runs after the wrapper is gone (dropped when tracing stops) writes into live memory. The reducer waits on the same future before backward
// ends, but our callback may run a moment after that wait returns: take() waits for a
// record's completion at most `wait_us` before reporting it unfinished (done = 0).

#include <torch/extension.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <time.h>
#include <vector>

namespace {

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct Record {
  std::atomic<int64_t> launch_ns{0};
  std::atomic<int64_t> done_ns{0};
  std::atomic<int64_t> bytes{0};
};

class TimedGroup : public c10d::ProcessGroup {
 public:
  TimedGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner, int64_t capacity)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        records_(new Record[capacity], std::default_delete<Record[]>()),
        capacity_(capacity) {
    // The real group's backends, shared: collectives not overridden here (the
    // reducer's broadcast when it rebuilds its buckets) dispatch to them as they would.
    if (auto bound = inner_->getBoundDeviceId()) {
      setBoundDeviceId(bound);
    }
    for (const auto& device : inner_->getDeviceTypes()) {
      setBackend(device.type(), inner_->getBackendType(), inner_->getBackend(device.type()));
    }
    setDefaultBackend(inner_->getBackendType());
    setGroupName(inner_->getGroupName());
  }

  const std::string getBackendName() const override {
    return inner_->getBackendName();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    Record* rec = i < capacity_ ? &records_.get()[i] : nullptr;  // full: not stamped
    if (rec != nullptr) {
      int64_t bytes = 0;
      for (const auto& t : tensors) {
        bytes += static_cast<int64_t>(t.numel()) * t.element_size();
      }
      rec->bytes.store(bytes, std::memory_order_relaxed);
      rec->done_ns.store(0, std::memory_order_relaxed);
      rec->launch_ns.store(monotonic_ns(), std::memory_order_release);
    }
    auto work = inner_->allreduce(tensors, opts);
    if (rec != nullptr) {
      work->getFuture()->addCallback([records = records_, rec](c10::ivalue::Future&) {
        rec->done_ns.store(monotonic_ns(), std::memory_order_release);
      });
    }
    return work;
  }

  // Every all-reduce since the last take() that fit: [(launch_ns, done_ns, bytes)], then
  // starts again. Called between steps (no all-reduce in flight).
  std::vector<std::tuple<int64_t, int64_t, int64_t>> take(int64_t wait_us) {
    const int64_t n = std::min(next_.load(std::memory_order_acquire), capacity_);
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    out.reserve(n);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(wait_us);
    Record* records = records_.get();
    for (int64_t i = 0; i < n; ++i) {
      int64_t done = records[i].done_ns.load(std::memory_order_acquire);
      while (done == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
        done = records[i].done_ns.load(std::memory_order_acquire);
      }
      out.emplace_back(records[i].launch_ns.load(std::memory_order_acquire), done,
                       records[i].bytes.load(std::memory_order_relaxed));
    }
    next_.store(0, std::memory_order_release);
    return out;
  }

  std::pair<int64_t, int64_t> progress() const {
    const int64_t n = std::min(next_.load(std::memory_order_acquire), capacity_);
    int64_t done = 0;
    for (int64_t i = 0; i < n; ++i) {
      done += records_.get()[i].done_ns.load(std::memory_order_relaxed) != 0;
    }
    return {n, done};
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
  std::shared_ptr<Record> records_;  // an array (default_delete<Record[]>), shared with callbacks
  const int64_t capacity_;
  std::atomic<int64_t> next_{0};
};

// (parameter index, CLOCK_MONOTONIC ns) per accumulated gradient, in order.
class ReadyTimes {
 public:
  ReadyTimes(const std::vector<at::Tensor>& params, int64_t capacity)
      : records_(new std::pair<std::atomic<int64_t>, std::atomic<int64_t>>[capacity]), capacity_(capacity) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto node = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(node, "parameter ", i, " has no gradient accumulator (does it require grad?)");
      auto hook = std::make_unique<Hook>(this, static_cast<int64_t>(i));
      keys_.emplace_back(node, reinterpret_cast<uintptr_t>(hook.get()));
      auto& hooks = node->post_hooks();
      hooks.insert(hooks.begin(), std::move(hook));  // before DDP's hook on the same node
    }
  }

  ~ReadyTimes() {
    remove();
  }

  // Takes the hooks off (between steps: no backward running).
  void remove() {
    for (auto& [node, key] : keys_) {
      node->del_post_hook(key);
    }
    keys_.clear();
  }

  void stamp(int64_t param) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i < capacity_) {
      records_[i].first.store(param, std::memory_order_relaxed);
      records_[i].second.store(monotonic_ns(), std::memory_order_release);
    }
  }

  std::vector<std::pair<int64_t, int64_t>> take() {
    const int64_t n = std::min(next_.load(std::memory_order_acquire), capacity_);
    std::vector<std::pair<int64_t, int64_t>> out;
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      out.emplace_back(records_[i].first.load(std::memory_order_relaxed),
                       records_[i].second.load(std::memory_order_acquire));
    }
    next_.store(0, std::memory_order_release);
    return out;
  }

 private:
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(ReadyTimes* owner, int64_t param) : owner_(owner), param_(param) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      owner_->stamp(param_);
      return outputs;
    }
    ReadyTimes* owner_;
    int64_t param_;
  };

  std::unique_ptr<std::pair<std::atomic<int64_t>, std::atomic<int64_t>>[]> records_;
  const int64_t capacity_;
  std::atomic<int64_t> next_{0};
  std::vector<std::pair<c10::intrusive_ptr<torch::autograd::Node>, uintptr_t>> keys_;
};

TimedGroup& as_timed(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto* timed = dynamic_cast<TimedGroup*>(group.get());
  TORCH_CHECK(timed != nullptr, "not a ddpscope TimedGroup");
  return *timed;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpscope: DDP bucket all-reduce timing beside the reducer's process group";
  m.def(
      "wrap",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& inner, int64_t capacity) {
        TORCH_CHECK(capacity > 0, "capacity must be > 0");
        return c10::intrusive_ptr<c10d::ProcessGroup>(c10::make_intrusive<TimedGroup>(inner, capacity));
      },
      py::arg("group"), py::arg("capacity") = 4096);
  m.def(
      "take", [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, int64_t wait_us) { return as_timed(g).take(wait_us); },
      py::arg("group"), py::arg("wait_us") = 10000, py::call_guard<py::gil_scoped_release>());
  m.def(
      "progress", [](const c10::intrusive_ptr<c10d::ProcessGroup>& g) { return as_timed(g).progress(); },
      "(launched, done) all-reduces since the last take(): where a backward is, for the live file");
  py::class_<ReadyTimes, std::shared_ptr<ReadyTimes>>(m, "ReadyTimes")
      .def(py::init<const std::vector<at::Tensor>&, int64_t>(), py::arg("params"), py::arg("capacity") = 1 << 16)
      .def("take", &ReadyTimes::take, py::call_guard<py::gil_scoped_release>())
      .def("remove", &ReadyTimes::remove);
}
