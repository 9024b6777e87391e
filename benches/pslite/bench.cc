// The ps-lite side of the transport comparison (`scripts/bench-pslite.sh` builds and runs it; see
// docs/performance.md). It mirrors `benches/transport.rs`: one server that sums each push into
// the stored tensor and answers a pull with it, and one worker that pushes or pulls one tensor
// (one key, ps-lite's zero-copy ZPush/ZPull) synchronously or with 8 requests in flight (8
// keys, one request outstanding per key, as the Rust benchmark's 8 workers). Sizes 1 KiB,
// 64 KiB, 1 MiB and 16 MiB; each cell warms up for PSBENCH_WARMUP_S seconds (default 1), then
// counts requests for PSBENCH_SECONDS (default 3). The worker prints one line per cell:
//
//   pslite 1MiB push sync 3512.3 MB/s 3350 req/s cpu 0.41 s/GB
//
// CPU is the worker's and the server's user and system time over the measured span, per GB
// (10^9 bytes) moved; the server's process id comes in PSBENCH_SERVER_PID. PSBENCH_FILTER
// keeps the cells whose name ("1MiB push sync") contains it.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "ps/ps.h"

using namespace ps;

namespace {

std::unordered_map<Key, SArray<float>> store;

void Handle(const KVMeta& meta, const KVPairs<float>& req, KVServer<float>* server) {
  KVPairs<float> res;
  size_t n = req.keys.size();
  if (meta.push) {
    size_t len = req.vals.size() / n;
    for (size_t i = 0; i < n; ++i) {
      SArray<float>& s = store[req.keys[i]];
      if (s.size() != len) {
        s.resize(len, 0.0f);
      }
      const float* g = req.vals.data() + i * len;
      float* p = s.data();
      for (size_t j = 0; j < len; ++j) p[j] += g[j];
    }
  } else {
    res.keys = req.keys;
    if (n == 1) {
      res.vals = store[req.keys[0]];  // shared, not copied
    } else {
      for (size_t i = 0; i < n; ++i) res.vals.append(store[req.keys[i]]);
    }
  }
  server->Response(meta, res);
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double SelfCpu() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
}

// utime + stime of a process, from /proc/PID/stat (fields 14 and 15, in clock ticks).
double ProcCpu(const char* pid) {
  if (pid == nullptr) return 0.0;
  std::ifstream f(std::string("/proc/") + pid + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0.0;
  std::vector<std::string> fields;
  size_t at = close + 2;
  while (at < stat.size()) {
    size_t end = stat.find(' ', at);
    if (end == std::string::npos) end = stat.size();
    fields.push_back(stat.substr(at, end - at));
    at = end + 1;
  }
  // fields[0] is field 3 (state); utime is field 14, stime 15.
  if (fields.size() < 13) return 0.0;
  return (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
}

double EnvSeconds(const char* name, double fallback) {
  const char* v = getenv(name);
  return v ? atof(v) : fallback;
}

void RunWorker() {
  KVWorker<float> kv(0, 0);
  const double warmup = EnvSeconds("PSBENCH_WARMUP_S", 1.0), span = EnvSeconds("PSBENCH_SECONDS", 3.0);
  const char* filter = getenv("PSBENCH_FILTER");
  const char* server_pid = getenv("PSBENCH_SERVER_PID");
  const std::vector<std::pair<const char*, size_t>> sizes = {
      {"1KiB", 1 << 10}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"16MiB", 16 << 20}};
  const int kInFlight = 8;
  for (auto& [label, bytes] : sizes) {
    size_t floats = bytes / 4;
    std::vector<SArray<Key>> keys(kInFlight);
    std::vector<SArray<float>> grads(kInFlight), outs(kInFlight);
    for (int k = 0; k < kInFlight; ++k) {
      keys[k].push_back(static_cast<Key>(k));
      grads[k].resize(floats, 1.0f);
      outs[k].resize(floats, 0.0f);
      kv.Wait(kv.ZPush(keys[k], grads[k]));  // the server allocates the tensor
    }
    for (bool push : {true, false}) {
      for (int in_flight : {1, kInFlight}) {
        std::string cell = std::string(label) + (push ? " push " : " pull ") + (in_flight == 1 ? "sync" : "8-in-flight");
        if (filter && cell.find(filter) == std::string::npos) continue;
        auto issue = [&](int k) {
          return push ? kv.ZPush(keys[k], grads[k]) : kv.ZPull(keys[k], &outs[k]);
        };
        std::vector<int> pending(in_flight);
        for (int k = 0; k < in_flight; ++k) pending[k] = issue(k);
        long done = 0;
        double start = Seconds(), measured_from = start + warmup, end = measured_from + span;
        double cpu0 = 0, t0 = 0;
        long done0 = 0;
        bool measuring = false;
        for (;;) {
          for (int k = 0; k < in_flight; ++k) {
            kv.Wait(pending[k]);
            ++done;
            pending[k] = issue(k);
          }
          double now = Seconds();
          if (!measuring && now >= measured_from) {
            measuring = true;
            t0 = now;
            done0 = done;
            cpu0 = SelfCpu() + ProcCpu(server_pid);
          } else if (measuring && now >= end) {
            double secs = now - t0, cpu = SelfCpu() + ProcCpu(server_pid) - cpu0;
            double moved = static_cast<double>(done - done0) * bytes;
            printf("pslite %s %.1f MB/s %.0f req/s cpu %.3f s/GB\n", cell.c_str(), moved / secs / 1e6,
                   (done - done0) / secs, cpu / (moved / 1e9));
            fflush(stdout);
            break;
          }
        }
        for (int k = 0; k < in_flight; ++k) kv.Wait(pending[k]);
      }
    }
  }
}

}  // namespace

int main() {
  Start(0);
  if (IsServer()) {
    auto server = new KVServer<float>(0);
    server->set_request_handle(Handle);
    RegisterExitCallback([server]() { delete server; });
  }
  if (IsWorker()) RunWorker();
  Finalize(0, true);
  return 0;
}
