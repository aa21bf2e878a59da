// TimedGroup: a process group for DDP's reducer that forwards every collective to the
// real group and stamps each all-reduce's launch and completion, without the GIL.
//
// DDP's reducer launches a bucket's all-reduce from the autograd thread through
// process_group_->allreduce (its default communication "hook" is C++). Installed with
// Reducer::update_process_group, this wrapper sees every bucket while DDP keeps its fused
// divide-while-copying path (no Python hook is registered, so none turns it off).
//
// Host times are CLOCK_MONOTONIC nanoseconds, the clock of Python's time.perf_counter_ns
// on Linux, so they sit on the same axis as the tracer's Python stamps. Launch is stamped
// before the call into the real group, completion in a callback on the returned Work's
// future (gloo on CPU: when the collective is done).
//
// Device times (a CUDA group: NCCL, or gloo with CUDA tensors). A host clock alone is wrong
// there: an NCCL future completes when the kernel is enqueued. Each record then also gets
// two timing-enabled c10::Events: "launch", recorded on the tensors' current stream before
// the call (the collective's stream waits for that stream, so the collective cannot start
// before it), and "done", recorded in the future's callback, which c10::ivalue::Future runs
// on a stream made to wait for the collective's work, so the event completes when the
// collective does. Both are read when the recorder resolves their step (settle()), its work
// completed: no CPU-GPU synchronisation inside a step. They map onto the host clock through *anchors*:
// events whose host times are known. The first is taken at wrap() (after waiting for the
// current stream, before training); after that the Python clock (cuda_clock.py) shares its
// own: at each of its tries it has this group record a candidate event on its idle anchor
// stream just before its own event, and commits the winning try's host time to both, so
// compute and bucket lanes sit on one anchor, with the host-per-device rate the clock measured.
// Each all-reduce is measured from the newest anchor when it was launched (float32
// milliseconds from an anchor a few seconds back, not from the start of the run), times that rate.
//
// ReadyTimes stamps each parameter's gradient-ready time with a post hook inserted at
// the front of its AccumulateGrad node: it runs when the gradient is accumulated,
// before DDP's own hook on that node (which may launch the bucket), on the autograd
// thread, without the GIL: the host clock, and on a device group also an event on the
// device's current stream from a preallocated ring, measured from the group's anchors
// (a Python hook and a torch.cuda.Event per gradient, resolved in Python, cost the
// training thread tens of µs each on a GPU host).
//
// Records go into a preallocated array (no allocation on the hot path) of banks, one per
// take(): the one being filled and, on a device group, those taken whose device events are
// still to be read: settle() reads the oldest, when the recorder resolves its step (its end
// done on the device: nothing to wait for). Only a take() that finds every bank waiting
// reads the oldest at once, waiting for its events if need be: the host may run
// kDeviceBanks - 1 takes ahead of the device before a bucket's times make it wait (reading
// them at the next take, as this did with two banks, made it wait whenever the device was a
// step behind; the stand-in device's test found it). Completion callbacks hold the records too, so one that runs after
// the wrapper is gone (dropped when tracing stops) writes into live memory. The reducer
// waits on the same future before backward ends, but our callback may run a moment after
// that wait returns: take() waits for a record's completion at most `wait_us` before
// reporting it unfinished (done = 0); the GIL is released only while it waits.

#include <torch/extension.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <time.h>
#include <tuple>
#include <utility>
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
  // Every tensor holds floating-point (or complex) data: a gradient bucket. DDP's reducer
  // also all-reduces its map of locally used parameters (int32) on this group, when it
  // looks for unused parameters: that one is not a bucket.
  std::atomic<bool> floating{true};
  std::atomic<int64_t> anchor{0};  // the newest anchor when it was launched
};

using HostRecords = std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>;  // (launch_ns, done_ns, bytes, floating)
// (launch_ns, done_ns, kernel_ns); 0: unknown. kernel_ns: the backend's own timing of the collective
// (NCCL's start and end events, when its collectives timing is on: Work::getDuration).
using DeviceRecords = std::vector<std::tuple<int64_t, int64_t, int64_t>>;

// What the records and their callbacks share (outlives the wrapper while a callback may run).
struct Records {
  static constexpr int kDeviceBanks = 8;  // takes (steps' syncing passes) whose device times may wait

  Records(int64_t capacity, std::optional<c10::Device> device)
      : capacity(capacity), banks(device ? kDeviceBanks : 2), host(banks * capacity), device(device) {
    if (device) {
      works.resize(banks * capacity);
      events.reserve(2 * banks * capacity);  // banks x capacity x {launch, done}; made lazily by record()
      for (int64_t i = 0; i < 2 * banks * capacity; ++i) {
        events.emplace_back(device->type(), c10::EventFlag::BACKEND_DEFAULT);
      }
    }
  }
  Record& at(int bank, int64_t i) {
    return host[bank * capacity + i];
  }
  c10::Event& launch_event(int bank, int64_t i) {
    return events[2 * (bank * capacity + i)];
  }
  c10::Event& done_event(int bank, int64_t i) {
    return events[2 * (bank * capacity + i) + 1];
  }
  void record(c10::Event& event) const {  // on the calling thread's current stream of the device
    c10::impl::VirtualGuardImpl impl(device->type());
    event.record(impl.getStream(*device));
  }

  const int64_t capacity;
  const int banks;
  std::vector<Record> host;
  const std::optional<c10::Device> device;
  std::vector<c10::Event> events;
  // Each record's Work, kept until its device times are read (a device group whose backend
  // times its collectives: its duration is read then, never waited for).
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::atomic<bool> kernel_timing{false};
};

// Device events whose host times are known (see the header): a ring of the newest kAnchors,
// each with the host-per-device rate to the next. Shared by a device group's records and the
// ready hooks (ReadyTimes), so the bucket, gradient-ready and compute lanes sit on one mapping.
// Anchors are added on the training thread between steps; stamps read the newest index.
struct Anchors {
  static constexpr int64_t kAnchors = 64;  // a stamp is read a step or two after it was recorded
  static constexpr int64_t kCandidates = 8;

  Anchors() : events(kAnchors), ns(kAnchors, 0), rate(kAnchors, 1.0), candidates(kCandidates) {}

  int64_t newest() const {
    return count.load(std::memory_order_acquire) - 1;
  }

  // The newest anchor, at host_ns; `rate` (host per device ns) applies from the anchor before
  // it on. The Python clock decides the rate (cuda_clock.py: measured over a long baseline)
  // and hands the same one to both sets of events.
  void add(std::unique_ptr<c10::Event> event, int64_t host_ns, double r) {
    const int64_t n = count.load(std::memory_order_relaxed);
    if (n > 0) {
      rate[(n - 1) % kAnchors] = r;
    }
    const int64_t slot = n % kAnchors;
    events[slot] = std::move(event);
    ns[slot] = host_ns;
    rate[slot] = r;
    count.store(n + 1, std::memory_order_release);
  }

  // An event's time on the host clock, measured from anchor `anchor` (the newest when it was
  // recorded; one dropped from the ring is replaced by the oldest kept). `known_done`: the
  // caller saw a later event on its stream complete, so no query first (a driver call per
  // event, on the training thread); one that had not completed after all (recorded on
  // another stream) throws in elapsedTime, and is waited for then. Every wait is counted
  // (`waits`: the buckets', the gradients' and the clock's stamps' on these anchors).
  int64_t host_ns(const c10::Event& event, int64_t anchor, bool known_done = false) const {
    if (!known_done && !event.query()) {
      event.synchronize();  // this event only: work still running when it is read (rare)
      waits.fetch_add(1, std::memory_order_relaxed);
    }
    const int64_t n = count.load(std::memory_order_acquire);
    anchor = std::min(std::max(anchor, std::max<int64_t>(0, n - kAnchors)), n - 1);
    const int64_t slot = anchor % kAnchors;
    double ms = 0.0;
    // elapsedTime sets the event's device and sets it back, but not when it throws: the guard does
    std::optional<c10::DeviceGuard> guard;
    if (known_done) {
      guard.emplace(event.device());
    }
    try {
      ms = events[slot]->elapsedTime(event);
    } catch (const c10::Error&) {
      if (!known_done) {
        throw;
      }
      event.synchronize();  // not completed after all: this event only
      waits.fetch_add(1, std::memory_order_relaxed);
      ms = events[slot]->elapsedTime(event);
    }
    return ns[slot] + static_cast<int64_t>(std::llround(ms * 1e6 * rate[slot]));  // ms -> ns
  }

  std::vector<std::unique_ptr<c10::Event>> events;
  std::vector<int64_t> ns;
  std::vector<double> rate;  // host ns per device ns from each anchor to the next
  std::vector<std::unique_ptr<c10::Event>> candidates;
  std::atomic<int64_t> count{0};
  mutable std::atomic<int64_t> waits{0};  // events read before they completed, waited for (that event only)
};

class TimedGroup : public c10d::ProcessGroup {
 public:
  TimedGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner, int64_t capacity, std::optional<c10::Device> device)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        records_(std::make_shared<Records>(capacity, device)) {
    // The real group's backends, shared: collectives not overridden here (the
    // reducer's broadcast when it rebuilds its buckets) dispatch to them as they would.
    if (auto bound = inner_->getBoundDeviceId()) {
      setBoundDeviceId(bound);
    }
    // Each device type under its own backend's type: a "cpu:gloo,cuda:nccl" group (what
    // init_process_group() gives on a GPU machine) registered under one type would route
    // every device to the backend registered first (setBackend reuses a type's backend).
    for (const auto& type : inner_->getDeviceTypes()) {
      auto backend = inner_->getBackend(type.type());
      setBackend(type.type(), c10d::ProcessGroup::strToBackendType(backend->getBackendName()), backend);
    }
    setDefaultBackend(inner_->getBackendType());
    setGroupName(inner_->getGroupName());
    if (device) {
      anchors_ = std::make_shared<Anchors>();
      auto first = std::make_unique<c10::Event>(device->type(), c10::EventFlag::BACKEND_DEFAULT);
      records_->record(*first);
      first->synchronize();  // this event only, at wrap() (before training): "now" is its host time
      anchors_->add(std::move(first), monotonic_ns(), 1.0);
    }
  }

  // The group's anchors (a device group's; null on the host), for the ready hooks to share.
  std::shared_ptr<Anchors> anchors() const {
    return anchors_;
  }

  std::optional<c10::Device> device() const {
    return records_->device;
  }

  // Anchor try `index`: an event on `stream` (the clock's idle anchor stream).
  void anchor_candidate(int64_t index, const c10::Stream& stream) {
    TORCH_CHECK(records_->device, "anchors are for a device group");
    auto& slot = anchors_->candidates.at(index % Anchors::kCandidates);
    slot = std::make_unique<c10::Event>(records_->device->type(), c10::EventFlag::BACKEND_DEFAULT);
    slot->record(stream);
  }

  // Try `index` won: its event is the newest anchor, at host_ns on the host clock, `rate` from
  // the anchor before it on.
  void anchor_commit(int64_t index, int64_t host_ns, double rate) {
    auto& slot = anchors_->candidates.at(index % Anchors::kCandidates);
    TORCH_CHECK(slot, "anchor try ", index, " was not recorded");
    if (!slot->query()) {
      slot->synchronize();  // this event only; the clock's later event on the same stream is done
    }
    anchors_->add(std::move(slot), host_ns, rate);
  }

  const std::string getBackendName() const override {
    return inner_->getBackendName();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    const int bank = bank_.load(std::memory_order_relaxed);
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    const bool stamped = i < records_->capacity;  // full: not stamped
    if (stamped) {
      Record& rec = records_->at(bank, i);
      int64_t bytes = 0;
      bool floating = true;
      for (const auto& t : tensors) {
        bytes += static_cast<int64_t>(t.numel()) * t.element_size();
        floating = floating && (t.is_floating_point() || t.is_complex());
      }
      rec.bytes.store(bytes, std::memory_order_relaxed);
      rec.floating.store(floating, std::memory_order_relaxed);
      rec.anchor.store(records_->device ? anchors_->newest() : 0, std::memory_order_relaxed);
      rec.done_ns.store(0, std::memory_order_relaxed);
      if (records_->device) {
        records_->record(records_->launch_event(bank, i));
      }
      rec.launch_ns.store(monotonic_ns(), std::memory_order_release);
    }
    auto work = inner_->allreduce(tensors, opts);
    if (stamped && records_->device && records_->kernel_timing.load(std::memory_order_relaxed)) {
      records_->works[bank * records_->capacity + i] = work;
    }
    if (stamped) {
      work->getFuture()->addCallback([records = records_, bank, i](c10::ivalue::Future&) {
        if (records->device) {
          records->record(records->done_event(bank, i));
        }
        records->at(bank, i).done_ns.store(monotonic_ns(), std::memory_order_release);
      });
    }
    return work;
  }

  // The all-reduces since the last take() that fit, on the host clock, and the device times
  // of those the previous take() handed over (empty without a device). Called between steps
  // (no all-reduce in flight). A take() with nothing new keeps the previous ones pending.
  // Whether every all-reduce since the last take() has completed (its callback ran).
  bool all_done() const {
    const auto [n, done] = progress();
    return n == done;
  }

  // Waits (at most wait_us) for the callbacks of the all-reduces since the last take().
  void wait_done(int64_t wait_us) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(wait_us);
    while (!all_done() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
  }

  std::pair<HostRecords, DeviceRecords> take() {
    const int bank = bank_.load(std::memory_order_relaxed);
    const int64_t n = std::min(next_.load(std::memory_order_acquire), records_->capacity);
    HostRecords out;
    if (n == 0) {
      return {out, {}};
    }
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      Record& rec = records_->at(bank, i);
      out.emplace_back(rec.launch_ns.load(std::memory_order_acquire), rec.done_ns.load(std::memory_order_acquire),
                       rec.bytes.load(std::memory_order_relaxed), rec.floating.load(std::memory_order_relaxed));
    }
    DeviceRecords oldest;
    if (records_->device) {
      waiting_.emplace_back(bank, n);
      if (static_cast<int>(waiting_.size()) == records_->banks) {  // the next bank to fill still waits
        oldest = settle(false);  // its events are waited for if need be: the device is that far behind
      }
    }
    bank_.store((bank + 1) % records_->banks, std::memory_order_relaxed);
    next_.store(0, std::memory_order_release);
    return {out, oldest};
  }

  // The device times of the oldest take() whose device times were not read yet (empty: none):
  // when its step is resolved. Waits for an event that has not completed (that event only);
  // `known_done`: the caller saw a later event on the compute stream complete, so none is
  // queried first (one that had not completed after all is waited for: Anchors::host_ns).
  DeviceRecords settle(bool known_done) {
    DeviceRecords out;
    if (!records_->device || waiting_.empty()) {
      return out;
    }
    const auto [bank, n] = waiting_.front();
    waiting_.pop_front();
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const Record& rec = records_->at(bank, i);
      const bool done = rec.done_ns.load(std::memory_order_acquire) != 0;
      const int64_t anchor = rec.anchor.load(std::memory_order_relaxed);
      out.emplace_back(anchors_->host_ns(records_->launch_event(bank, i), anchor, known_done),
                       done ? anchors_->host_ns(records_->done_event(bank, i), anchor, known_done) : 0,
                       done ? kernel_ns(bank * records_->capacity + i) : 0);
    }
    return out;
  }


  void set_kernel_timing(bool on) {
    records_->kernel_timing.store(on && records_->device.has_value(), std::memory_order_relaxed);
  }

  std::pair<int64_t, int64_t> progress() const {
    const int bank = bank_.load(std::memory_order_relaxed);
    const int64_t n = std::min(next_.load(std::memory_order_acquire), records_->capacity);
    int64_t done = 0;
    for (int64_t i = 0; i < n; ++i) {
      done += records_->at(bank, i).done_ns.load(std::memory_order_relaxed) != 0;
    }
    return {n, done};
  }

 private:
  // The backend's own duration of record `slot`'s collective (ns), 0 if it has none; the Work
  // is released either way. Read after its done event completed: getDuration never waits.
  int64_t kernel_ns(int64_t slot) {
    auto work = std::move(records_->works[slot]);
    if (!work) {
      return 0;
    }
    try {
      return static_cast<int64_t>(std::llround(static_cast<double>(work->getDuration()) * 1e6));  // ms -> ns
    } catch (const std::exception&) {  // not timed by this backend, or not at this moment
      return 0;
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
  std::shared_ptr<Records> records_;
  std::atomic<int> bank_{0};
  std::atomic<int64_t> next_{0};
  std::deque<std::pair<int, int64_t>> waiting_;  // (bank, records) of takes not read on the device, oldest first
  std::shared_ptr<Anchors> anchors_;  // device groups only
};

TimedGroup& as_timed(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto* timed = dynamic_cast<TimedGroup*>(group.get());
  TORCH_CHECK(timed != nullptr, "not a ddpscope TimedGroup");
  return *timed;
}

// A ring of preallocated timing events on a device group's anchors (ReadyTimes keeps one for
// the gradients, DeviceStamps one for the CUDA clock's stamps). record() hands out slots in
// order, each an event recorded on the calling thread's current stream of the group's device
// (no sync: read a step or more later) and tied to the newest anchor; resolve(slots) gives
// their host times once their work has completed. A slot is reused only after a resolve()
// released it (every slot up to the largest it was given), so a record() that finds the ring
// full gets -1 rather than overwrite an event still to be read; a slot left behind by such a
// release and then handed out again reads 0 (`readable`), never the newer event's time.
// Events are created lazily by their first record.
class EventRing {
 public:
  EventRing(TimedGroup& timed, int64_t at_least) {
    device_ = timed.device();
    anchors_ = timed.anchors();
    TORCH_CHECK(device_ && anchors_, "device events need a device group");
    ring_ = 1;
    while (ring_ < at_least) {
      ring_ *= 2;
    }
    events_.reserve(ring_);
    for (int64_t i = 0; i < ring_; ++i) {
      events_.emplace_back(device_->type(), c10::EventFlag::BACKEND_DEFAULT);
    }
    event_anchor_.assign(ring_, 0);
  }

  int64_t record() {
    // A try that finds the ring full takes no slot: one that did (a fetch_add) pushed the
    // oldest slot still to be read out of `readable`, and its time was lost (the stand-in
    // device's test, tests/tracer/capture/test_device_path.py, found it).
    int64_t id = issued_.load(std::memory_order_relaxed);
    do {
      if (id - released_.load(std::memory_order_acquire) >= ring_) {
        return -1;
      }
    } while (!issued_.compare_exchange_weak(id, id + 1, std::memory_order_relaxed));
    const int64_t k = id & (ring_ - 1);
    event_anchor_[k] = anchors_->newest();
    c10::impl::VirtualGuardImpl impl(device_->type());
    events_[k].record(impl.getStream(*device_));  // no sync: an event on the stream
    return id;
  }

  bool query(int64_t slot) const {
    return !readable(slot) || events_[slot & (ring_ - 1)].query();
  }

  // Host ns (+ skew_ns) of each slot (0: -1, or a slot no longer readable), in the order given;
  // slots up to the largest given are released for reuse. Waits only for an event not completed
  // yet (this event, never the device: counted in `blocked`); `known_done`: see Anchors::host_ns.
  std::vector<int64_t> resolve(const std::vector<int64_t>& slots, int64_t skew_ns, bool known_done) {
    std::vector<int64_t> out;
    out.reserve(slots.size());
    int64_t last = -1;
    for (const int64_t slot : slots) {
      if (!readable(slot)) {
        out.push_back(0);
        continue;
      }
      const int64_t k = slot & (ring_ - 1);
      out.push_back(anchors_->host_ns(events_[k], event_anchor_[k], known_done) + skew_ns);
      last = std::max(last, slot);
    }
    if (last >= released_.load(std::memory_order_relaxed)) {
      released_.store(last + 1, std::memory_order_release);
    }
    return out;
  }

  int64_t issued() const {
    return issued_.load(std::memory_order_relaxed);
  }

  // Events read on these anchors that had to be waited for: this ring's, and the group's
  // other rings' and buckets'.
  int64_t blocked() const {
    return anchors_->waits.load(std::memory_order_relaxed);
  }

 private:
  // recorded, and not overwritten since (its slot reused by a record `ring` later)
  bool readable(int64_t slot) const {
    const int64_t issued = issued_.load(std::memory_order_relaxed);
    return slot >= 0 && slot < issued && issued - slot <= ring_;
  }

  std::optional<c10::Device> device_;
  std::shared_ptr<Anchors> anchors_;
  int64_t ring_ = 0;  // a power of two
  std::vector<c10::Event> events_;
  std::vector<int64_t> event_anchor_;  // the newest anchor when each slot was recorded
  std::atomic<int64_t> issued_{0};  // slots handed out (a try that found the ring full takes none)
  std::atomic<int64_t> released_{0};  // slots below this were resolved
};

// (parameter index, CLOCK_MONOTONIC ns) per accumulated gradient, in order; on a device
// group, also a timing-enabled event per gradient from an EventRing, recorded on the autograd
// thread's current stream of the device (the stream the accumulation ran on): take_device()
// gives (parameter, slot, pass) and resolve(slots), once the step's work has completed, their
// host times on the group's anchors (a gradient that found the ring full: slot -1, no device
// time).
class ReadyTimes {
 public:
  ReadyTimes(const std::vector<at::Tensor>& params, int64_t capacity,
             const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& group)
      : records_(new Stamp[capacity]), capacity_(capacity) {
    if (group) {
      // enough for a few steps of gradient accumulation on every parameter
      ring_ = std::make_unique<EventRing>(as_timed(*group),
                                          std::max<int64_t>(1024, 32 * static_cast<int64_t>(params.size())));
    }
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
    const int64_t only = only_.load(std::memory_order_relaxed);
    if (only >= 0 && param != only) {
      return;  // a step without gradient marks: only its last gradient is stamped (set_only)
    }
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= capacity_) {
      return;
    }
    Stamp& rec = records_[i];
    rec.param.store(param, std::memory_order_relaxed);
    rec.slot.store(ring_ ? ring_->record() : -1, std::memory_order_relaxed);  // read a step later
    rec.ns.store(monotonic_ns(), std::memory_order_release);
  }

  // (parameter, µs, pass_index) per gradient since the last take (µs: (ns + skew_ns) / 1000,
  // the Python clock's arithmetic): the tuples the recorder keeps, made here rather than
  // by a Python loop on the training thread. Host clock (a CPU group).
  std::vector<std::tuple<int64_t, double, int64_t>> take(int64_t pass_index, int64_t skew_ns) {
    const int64_t n = std::min(next_.load(std::memory_order_acquire), capacity_);
    std::vector<std::tuple<int64_t, double, int64_t>> out;
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ns = records_[i].ns.load(std::memory_order_acquire);
      out.emplace_back(records_[i].param.load(std::memory_order_relaxed), (ns + skew_ns) / 1e3, pass_index);
    }
    next_.store(0, std::memory_order_release);
    return out;
  }

  // (parameter, slot, pass_index) per gradient since the last take, on a device group: the
  // slots' host times come from resolve() once the step's work has completed.
  std::vector<std::tuple<int64_t, int64_t, int64_t>> take_device(int64_t pass_index) {
    const int64_t n = std::min(next_.load(std::memory_order_acquire), capacity_);
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      records_[i].ns.load(std::memory_order_acquire);
      out.emplace_back(records_[i].param.load(std::memory_order_relaxed),
                       records_[i].slot.load(std::memory_order_relaxed), pass_index);
    }
    next_.store(0, std::memory_order_release);
    return out;
  }

  // Host ns (+ skew_ns) of each slot (0: -1 or no longer readable), in the order given (see
  // EventRing::resolve): the recorder calls it once the step's own end event has completed
  // (`known_done`: then no query per event) or when it must resolve the step anyway.
  std::vector<int64_t> resolve(const std::vector<int64_t>& slots, int64_t skew_ns, bool known_done) {
    TORCH_CHECK(ring_, "resolve is for device ready times");
    return ring_->resolve(slots, skew_ns, known_done);
  }

  bool on_device() const {
    return ring_ != nullptr;
  }

  // From the next gradient on, stamp only parameter `param` (-1: every parameter). Set between
  // steps by the recorder: a step without gradient marks keeps one, the gradient that was
  // ready last, for where its backward's compute ended (no event for the others on a device).
  void set_only(int64_t param) {
    only_.store(param, std::memory_order_relaxed);
  }

 private:
  struct Stamp {
    std::atomic<int64_t> param{0};
    std::atomic<int64_t> slot{-1};
    std::atomic<int64_t> ns{0};
  };
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

  std::unique_ptr<Stamp[]> records_;
  const int64_t capacity_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> only_{-1};  // set_only
  std::unique_ptr<EventRing> ring_;  // device ready times (a device group), else null
  // what grad_accumulator hands out: std::shared_ptr<Node> up to torch 2.12 (seen failing to
  // build against 2.11 on a GPU machine), c10::intrusive_ptr<Node> in 2.13
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<NodePtr, uintptr_t>> keys_;
};

// The CUDA clock's compute-side stamps (cuda_clock.py: forward, backward, optimizer, step
// ends), from an EventRing recorded on the calling thread's current stream of the group's
// device, on the group's anchors. A torch.cuda.Event per stamp, made, recorded and destroyed
// from Python, cost the training thread ~10 µs a stamp with the GPU idle and several times
// that in a launch-bound step on an H200 host. stamp() hands out a slot (-1 when every slot
// still waits to be read: the clock then makes an event), query(slot) says whether it
// completed (no sync), resolve(slots) gives host ns once it has.
class DeviceStamps {
 public:
  DeviceStamps(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int64_t ring)
      : ring_(as_timed(group), std::max<int64_t>(ring, 64)) {}

  int64_t stamp() {
    return ring_.record();
  }

  bool query(int64_t slot) const {
    return ring_.query(slot);
  }

  std::vector<int64_t> resolve(const std::vector<int64_t>& slots, bool known_done) {
    return ring_.resolve(slots, 0, known_done);
  }

  int64_t issued() const {
    return ring_.issued();
  }

  int64_t blocked() const {
    return ring_.blocked();
  }

 private:
  EventRing ring_;
};

// The distinct bytes that parameters' gradients hold (each (data pointer, size) region
// once, as memory.distinct_bytes counts them), read in C++ each step: a Python loop over
// every parameter's .grad costs ~1 µs a parameter on the cold caches after a step. -1 when
// a gradient is not a plain strided tensor (sparse, a subclass): Python counts that step.
class GradBytes {
 public:
  explicit GradBytes(std::vector<at::Tensor> params) : params_(std::move(params)) {}

  int64_t operator()() const {
    std::vector<std::pair<uintptr_t, int64_t>> regions;
    regions.reserve(params_.size());
    for (const auto& p : params_) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      if (g.layout() != c10::kStrided || !g.has_storage() || g.is_nested() ||
          g.unsafeGetTensorImpl()->is_python_dispatch()) {
        return -1;
      }
      const int64_t n = static_cast<int64_t>(g.nbytes());
      if (n > 0) {
        regions.emplace_back(reinterpret_cast<uintptr_t>(g.data_ptr()), n);
      }
    }
    std::sort(regions.begin(), regions.end());
    int64_t total = 0;
    for (size_t i = 0; i < regions.size(); ++i) {
      if (i == 0 || regions[i] != regions[i - 1]) {
        total += regions[i].second;
      }
    }
    return total;
  }

 private:
  std::vector<at::Tensor> params_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpscope: DDP bucket all-reduce timing beside the reducer's process group";
  m.def(
      "wrap",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& inner, int64_t capacity, std::optional<c10::Device> device) {
        TORCH_CHECK(capacity > 0, "capacity must be > 0");
        TORCH_CHECK(!device || device->type() != c10::DeviceType::CPU, "device timing is for accelerators");
        return c10::intrusive_ptr<c10d::ProcessGroup>(c10::make_intrusive<TimedGroup>(inner, capacity, device));
      },
      py::arg("group"), py::arg("capacity") = 4096, py::arg("device") = py::none(),
      "device: an accelerator whose events time the all-reduces too (None: host clock only)");
  m.def(
      "take",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, int64_t wait_us) {
        TimedGroup& timed = as_timed(g);
        if (!timed.all_done()) {  // a callback still to run: wait without the GIL (its thread may want it)
          py::gil_scoped_release release;
          timed.wait_done(wait_us);
        }
        return timed.take();
      },
      py::arg("group"), py::arg("wait_us") = 10000,
      "([(launch_ns, done_ns, bytes, floating)] since the last take (done 0: not completed within wait_us; "
      "floating False: not a gradient bucket), "
      "[(launch_ns, done_ns, kernel_ns)] on the device for the oldest take not read yet, read now because "
      "every bank waits (else empty: settle() reads it))");
  m.def(
      "settle",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, bool known_done) { return as_timed(g).settle(known_done); },
      py::arg("group"), py::arg("known_done") = false, py::call_guard<py::gil_scoped_release>(),
      "the device times of the oldest take's all-reduces not handed over yet (empty: none)");
  m.def(
      "kernel_timing", [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, bool on) { as_timed(g).set_kernel_timing(on); },
      py::arg("group"), py::arg("on"),
      "keep each all-reduce's Work until its device times are read, and read the backend's own duration of it "
      "(NCCL with its collectives timing on); device groups only");
  m.def(
      "anchor_candidate",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, int64_t index, int64_t stream_id, int64_t device_index,
         int64_t device_type) {
        as_timed(g).anchor_candidate(index, c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                                                 static_cast<c10::DeviceType>(device_type)));
      },
      py::arg("group"), py::arg("index"), py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"),
      "record anchor try `index` on that stream (the clock's idle anchor stream)");
  m.def(
      "anchor_commit",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& g, int64_t index, int64_t host_ns, double rate) {
        as_timed(g).anchor_commit(index, host_ns, rate);
      },
      py::arg("group"), py::arg("index"), py::arg("host_ns"), py::arg("rate") = 1.0,
      "try `index` is the newest anchor, at host_ns; rate: host per device time from the anchor before it");
  m.def(
      "progress", [](const c10::intrusive_ptr<c10d::ProcessGroup>& g) { return as_timed(g).progress(); },
      "(launched, done) all-reduces since the last take(): where a backward is, for the live file");
  py::class_<ReadyTimes, std::shared_ptr<ReadyTimes>>(m, "ReadyTimes")
      .def(py::init<const std::vector<at::Tensor>&, int64_t,
                    const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>&>(),
           py::arg("params"), py::arg("capacity") = 1 << 16, py::arg("group") = py::none(),
           "group: a device group (wrap(..., device)): each gradient also gets a device event on its anchors")
      .def("take", &ReadyTimes::take, py::arg("pass_index"), py::arg("skew_ns") = 0)
      .def("take_device", &ReadyTimes::take_device, py::arg("pass_index"))
      .def("resolve", &ReadyTimes::resolve, py::arg("slots"), py::arg("skew_ns") = 0, py::arg("known_done") = false,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("on_device", &ReadyTimes::on_device)
      .def("set_only", &ReadyTimes::set_only, py::arg("param"),
           "stamp only this parameter's gradient from now on (-1: every parameter's)")
      .def("remove", &ReadyTimes::remove);
  py::class_<DeviceStamps, std::shared_ptr<DeviceStamps>>(m, "DeviceStamps")
      .def(py::init<const c10::intrusive_ptr<c10d::ProcessGroup>&, int64_t>(), py::arg("group"),
           py::arg("ring") = 4096, "the CUDA clock's stamps on a device group's anchors (see DeviceStamps)")
      .def("stamp", &DeviceStamps::stamp, "a slot, its event recorded on the device's current stream; -1: ring full")
      .def("query", &DeviceStamps::query, py::arg("slot"), "completed (or not readable); no sync")
      .def("resolve", &DeviceStamps::resolve, py::arg("slots"), py::arg("known_done") = false,
           py::call_guard<py::gil_scoped_release>(),
           "host ns per slot (0: unknown), on the group's anchors")
      .def_property_readonly("issued", &DeviceStamps::issued)
      .def_property_readonly("blocked", &DeviceStamps::blocked);
  py::class_<GradBytes, std::shared_ptr<GradBytes>>(m, "GradBytes")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("params"))
      .def("__call__", &GradBytes::operator(), "distinct bytes of the gradients now, or -1: count them in Python");
}
