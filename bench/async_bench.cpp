// SPDX-License-Identifier: Apache-2.0
// The C API's latency for a small allreduce on a thread group of two, blocking beside
// non-blocking (iallreduce then wait), and a few requests in flight per wait. The library is
// loaded at run time, so the blocking figure can be taken from another build for a before/after:
//   async_bench [path/to/libgradsync.so.0]   (default: the one it was built with; a library
//                                           without the non-blocking calls gives the blocking row only)
// Figures: median over 7 batches of the mean time per call, with min and max.
#include <dlfcn.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "gradsync/gradsync.h"

namespace {

struct Api {
  decltype(&gradsync_comm_create) create;
  decltype(&gradsync_comm_free) free;
  decltype(&gradsync_comm_allreduce) allreduce;
  decltype(&gradsync_comm_iallreduce) iallreduce;
  decltype(&gradsync_request_wait) wait;
  decltype(&gradsync_request_free) request_free;
};

template <class F>
F sym(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

// Runs body(rank, comm, iterations) on both ranks; returns min / median / max microseconds per call.
template <class Body>
std::vector<double> measure(const Api& api, const char* name, Body&& body) {
  gradsync_comm* comms[2] = {nullptr, nullptr};
  std::barrier sync(2);
  std::vector<double> per;
  auto rank = [&](int r) {
    gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
    o.rank = r;
    o.size = 2;
    std::snprintf(o.name, sizeof o.name, "%s", name);
    if (api.create(&comms[r], &o) != GRADSYNC_OK) std::abort();
    body(r, comms[r], 20000);  // warm-up
    for (int batch = 0; batch < 7; ++batch) {
      const int n = 100000;
      sync.arrive_and_wait();
      const auto t0 = std::chrono::steady_clock::now();
      body(r, comms[r], n);
      sync.arrive_and_wait();
      if (r == 0)
        per.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n);
    }
    sync.arrive_and_wait();
    api.free(comms[r]);
  };
  std::thread t(rank, 1);
  rank(0);
  t.join();
  std::sort(per.begin(), per.end());
  return {per.front(), per[per.size() / 2], per.back()};
}

}  // namespace

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : GRADSYNC_LIBRARY_PATH;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "async_bench: %s\n", dlerror());
    return 1;
  }
  Api api{sym<decltype(Api::create)>(lib, "gradsync_comm_create"),
          sym<decltype(Api::free)>(lib, "gradsync_comm_free"),
          sym<decltype(Api::allreduce)>(lib, "gradsync_comm_allreduce"),
          sym<decltype(Api::iallreduce)>(lib, "gradsync_comm_iallreduce"),
          sym<decltype(Api::wait)>(lib, "gradsync_request_wait"),
          sym<decltype(Api::request_free)>(lib, "gradsync_request_free")};
  std::printf("%s\nC API, thread group of 2, allreduce of 1 f32 (sum); us per call, min / median / max of 7 batches\n",
              path);
  auto row = [](const char* what, const std::vector<double>& t, double base) {
    std::printf("%-34s | %7.3f %7.3f %7.3f | %6.2fx blocking\n", what, t[0], t[1], t[2], t[1] / base);
  };
  const auto blocking = measure(api, "bench-blocking", [&](int r, gradsync_comm* c, int n) {
    float v = static_cast<float>(r);
    for (int i = 0; i < n; ++i) api.allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM);
  });
  row("blocking allreduce", blocking, blocking[1]);
  if (api.iallreduce == nullptr) {
    std::printf("(this library has no non-blocking calls)\n");
    return 0;
  }
  const auto one = measure(api, "bench-one", [&](int r, gradsync_comm* c, int n) {
    float v = static_cast<float>(r);
    for (int i = 0; i < n; ++i) {
      gradsync_request* q = nullptr;
      api.iallreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM, &q);
      api.wait(q, -1);
      api.request_free(q);
    }
  });
  row("iallreduce + wait", one, blocking[1]);
  const auto eight = measure(api, "bench-eight", [&](int r, gradsync_comm* c, int n) {
    float v[8] = {};
    v[0] = static_cast<float>(r);
    gradsync_request* q[8];
    for (int i = 0; i < n; i += 8) {
      for (int k = 0; k < 8; ++k) api.iallreduce(c, &v[k], &v[k], 1, GRADSYNC_F32, GRADSYNC_SUM, &q[k]);
      for (int k = 0; k < 8; ++k) {
        api.wait(q[k], -1);
        api.request_free(q[k]);
      }
    }
  });
  row("8 iallreduce in flight, then waits", eight, blocking[1]);
  const auto after = measure(api, "bench-after", [&](int r, gradsync_comm* c, int n) {
    float v = static_cast<float>(r);
    gradsync_request* q = nullptr;
    api.iallreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM, &q);
    api.wait(q, -1);
    api.request_free(q);
    for (int i = 0; i < n; ++i) api.allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM);
  });
  row("blocking, progress thread running", after, blocking[1]);
  return 0;
}
