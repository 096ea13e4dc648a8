// SPDX-License-Identifier: Apache-2.0
#include "common/log.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <spdlog/sinks/base_sink.h>

namespace gradsync::log {
namespace {

// spdlog 1.10 (Debian 12) has no callback_sink: this sink formats a line and hands it to the
// host's hook, or to stderr when no hook is set. base_sink's mutex serialises calls, so the
// hook is never entered by two threads at once.
class HookSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void set_hook(gradsync_log_fn fn, void* user_data) {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = fn;
    user_data_ = user_data;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::string line(formatted.data(), formatted.size());
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (fn_ != nullptr) {
      fn_(user_data_, static_cast<int32_t>(msg.level), line.c_str());
    } else {
      line.push_back('\n');
      std::fwrite(line.data(), 1, line.size(), stderr);
    }
  }
  void flush_() override {
    if (fn_ == nullptr) std::fflush(stderr);
  }

 private:
  gradsync_log_fn fn_ = nullptr;
  void* user_data_ = nullptr;
};

int level_from_env() {
  const char* env = std::getenv("GRADSYNC_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return GRADSYNC_LOG_WARN;
  if (env[0] >= '0' && env[0] <= '6' && env[1] == '\0') return env[0] - '0';
  static const char* const names[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  for (int i = 0; i < 7; ++i)
    if (strcasecmp(env, names[i]) == 0) return i;
  if (strcasecmp(env, "warning") == 0) return GRADSYNC_LOG_WARN;
  return GRADSYNC_LOG_WARN;
}

struct State {
  std::shared_ptr<HookSink> sink = std::make_shared<HookSink>();
  spdlog::logger logger{"gradsync", sink};
  State() {
    logger.set_pattern("[gradsync %L %t] %v");
    logger.set_level(static_cast<spdlog::level::level_enum>(level_from_env()));
    logger.flush_on(spdlog::level::warn);
  }
};

State& state() {
  // Leaked on purpose: logging must keep working from threads that outlive static destruction.
  static State* s = new State();
  return *s;
}

}  // namespace

spdlog::logger& logger() { return state().logger; }

void set_callback(gradsync_log_fn fn, void* user_data, int level) {
  state().sink->set_hook(fn, user_data);
  set_level(level);
}

void set_level(int level) { state().logger.set_level(static_cast<spdlog::level::level_enum>(level)); }

int level() { return static_cast<int>(state().logger.level()); }

}  // namespace gradsync::log
