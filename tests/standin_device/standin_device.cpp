// A stand-in accelerator for tests, registered as PyTorch's PrivateUse1 device: streams and
// timing events with a GPU's semantics, on the host, so that the tracer's device path
// (tracer/capture/native/timed_group.cpp's events, rings and anchors; cuda_clock.py's
// scheduling through torch.Event and torch.Stream) runs in CI, where there is no GPU.
//
// THIS IS A STAND-IN, the one the project allows (issue 34: "a small stand-in for an event").
// It has no memory and runs no kernels: a CPU model is trained as usual and the tracer's
// events are recorded on this device's streams, as they would be on a GPU's beside the work.
//
// What it models, each on purpose:
// - A device clock of its own: device_ns = offset_ns + host_ns * (1 + drift_ppm / 1e6), so
//   that a mapping onto the host clock that ignores the anchors' offset or the drift is wrong
//   by that much.
// - Streams that run behind the host: an event recorded on a stream completes `lag_ns` after
//   it was recorded, and never before the stream's earlier work (FIFO), so query() says false
//   for a while, as a GPU's does while the CPU runs ahead; `busy(stream, ns)` queues work.
// - elapsedTime as cudaEventElapsedTime: float32 milliseconds, and an error (c10::Error) if
//   either event has not completed.
// - Counters of every synchronisation: a device-wide one (synchronizeDevice), a stream's, an
//   event's; the tests assert that the tracer never synchronises the device.
//
// Thread-safe: the autograd engine's thread records events too (the ready hooks).

// pybind11 and c10 only: torch/extension.h (all of ATen's headers) took 3x as long to build (34 s against 10 here)
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // counters() returns a std::map

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>
#include <time.h>

namespace py = pybind11;

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
using c10::StreamId;

int64_t host_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct StandInEvent {
  bool recorded = false;
  int64_t complete_ns = 0;  // host ns at which its stream reaches it
};

struct State {
  std::mutex mu;
  std::map<StreamId, int64_t> tail;  // host ns at which each stream's queued work completes
  std::map<StreamId, int64_t> lag;   // how far behind the host each stream runs (ns)
  std::map<StreamId, int64_t> recorded;  // events recorded on each stream so far
  StreamId next_stream = 1;
  double drift = 0.0;  // device ns per host ns, less 1
  int64_t offset_ns = 0;
  std::atomic<int64_t> device_syncs{0}, stream_syncs{0}, event_syncs{0}, records{0}, elapsed_calls{0};
};

State& state() {
  static State* s = new State();  // leaked: the guard impl outlives every static
  return *s;
}

thread_local StreamId current_stream = 0;

int64_t device_ns(int64_t host) {
  const State& s = state();
  return s.offset_ns + host + static_cast<int64_t>(std::llround(static_cast<double>(host) * s.drift));
}

void sleep_until(int64_t ns) {
  while (host_ns() < ns) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

struct StandInGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override {
    return DeviceType::PrivateUse1;
  }
  Device exchangeDevice(Device d) const override {
    TORCH_CHECK(d.index() <= 0, "the stand-in device has one device");
    return Device(DeviceType::PrivateUse1, 0);
  }
  Device getDevice() const override {
    return Device(DeviceType::PrivateUse1, 0);
  }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.index() <= 0, "the stand-in device has one device");
  }
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const override {
    return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, 0), current_stream);
  }
  Stream getDefaultStream(Device) const override {
    return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, 0), 0);
  }
  Stream getNewStream(Device, int) const override {
    std::lock_guard<std::mutex> lock(state().mu);
    return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, 0), state().next_stream++);
  }
  Stream exchangeStream(Stream s) const override {
    const StreamId old = current_stream;
    current_stream = s.id();
    return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, 0), old);
  }
  DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  void record(void** event, const Stream& stream, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) {
      *event = new StandInEvent();
    }
    auto* ev = static_cast<StandInEvent*>(*event);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    const int64_t now = host_ns();
    int64_t& tail = s.tail[stream.id()];
    tail = std::max(tail, now + s.lag[stream.id()]);
    ev->recorded = true;
    ev->complete_ns = tail;
    s.records.fetch_add(1, std::memory_order_relaxed);
    s.recorded[stream.id()] += 1;
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void* event) const override {
    auto* ev = static_cast<StandInEvent*>(event);
    return ev == nullptr || !ev->recorded || host_ns() >= ev->complete_ns;
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<StandInEvent*>(event);
  }
  bool queryStream(const Stream& stream) const override {
    std::lock_guard<std::mutex> lock(state().mu);
    return host_ns() >= state().tail[stream.id()];
  }
  void synchronizeStream(const Stream& stream) const override {
    state().stream_syncs.fetch_add(1, std::memory_order_relaxed);
    int64_t until;
    {
      std::lock_guard<std::mutex> lock(state().mu);
      until = state().tail[stream.id()];
    }
    sleep_until(until);
  }
  void synchronizeEvent(void* event) const override {
    state().event_syncs.fetch_add(1, std::memory_order_relaxed);
    auto* ev = static_cast<StandInEvent*>(event);
    if (ev != nullptr && ev->recorded) {
      sleep_until(ev->complete_ns);
    }
  }
  void synchronizeDevice(const DeviceIndex) const override {
    state().device_syncs.fetch_add(1, std::memory_order_relaxed);
    int64_t until = 0;
    {
      std::lock_guard<std::mutex> lock(state().mu);
      for (const auto& [id, t] : state().tail) {
        until = std::max(until, t);
      }
    }
    sleep_until(until);
  }
  double elapsedTime(void* event1, void* event2, const DeviceIndex) const override {
    state().elapsed_calls.fetch_add(1, std::memory_order_relaxed);
    auto* a = static_cast<StandInEvent*>(event1);
    auto* b = static_cast<StandInEvent*>(event2);
    TORCH_CHECK(a && b && a->recorded && b->recorded, "stand-in device: an event was not recorded");
    const int64_t now = host_ns();
    TORCH_CHECK(now >= a->complete_ns && now >= b->complete_ns,
                "stand-in device: device not ready (an event has not completed), as cudaErrorNotReady");
    const double ms = static_cast<double>(device_ns(b->complete_ns) - device_ns(a->complete_ns)) / 1e6;
    return static_cast<double>(static_cast<float>(ms));  // cudaEventElapsedTime: float32 ms
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, StandInGuard);

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "a stand-in accelerator (PrivateUse1) with GPU-like streams and events, for tests";
  m.attr("DEVICE_TYPE") = static_cast<int64_t>(DeviceType::PrivateUse1);
  m.def("current_stream_id", []() { return static_cast<int64_t>(current_stream); });
  m.def("configure", [](double drift_ppm, int64_t offset_ns) {
    std::lock_guard<std::mutex> lock(state().mu);
    state().drift = drift_ppm / 1e6;
    state().offset_ns = offset_ns;
  }, py::arg("drift_ppm") = 0.0, py::arg("offset_ns") = 0,
        "the device clock: offset_ns + host ns * (1 + drift_ppm / 1e6)");
  m.def("set_lag", [](int64_t stream_id, int64_t lag_ns) {
    std::lock_guard<std::mutex> lock(state().mu);
    state().lag[stream_id] = lag_ns;
  }, py::arg("stream_id"), py::arg("lag_ns"), "events on that stream complete lag_ns after they are recorded");
  m.def("busy", [](int64_t stream_id, int64_t ns) {
    std::lock_guard<std::mutex> lock(state().mu);
    int64_t& tail = state().tail[stream_id];
    tail = std::max(tail, host_ns()) + ns;
  }, py::arg("stream_id"), py::arg("ns"), "queue ns of work on that stream");
  m.def("device_ns", [](int64_t host) { return device_ns(host); }, py::arg("host_ns"));
  m.def("counters", []() {
    State& s = state();
    return std::map<std::string, int64_t>{
        {"device_syncs", s.device_syncs.load()}, {"stream_syncs", s.stream_syncs.load()},
        {"event_syncs", s.event_syncs.load()}, {"records", s.records.load()},
        {"elapsed_calls", s.elapsed_calls.load()}};
  }, "synchronisations and events so far");
  m.def("recorded", [](int64_t stream_id) {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().recorded[stream_id];
  }, py::arg("stream_id"), "events recorded on that stream so far");
}
