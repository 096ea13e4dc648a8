// SPDX-License-Identifier: Apache-2.0
#pragma once
// libgradsync's own spdlog logger, named "gradsync" and never registered in spdlog's global
// registry, so a host process that uses spdlog itself is unaffected.
#include <spdlog/spdlog.h>

#include "gradsync/log.h"

namespace gradsync::log {

spdlog::logger& logger();
void set_callback(gradsync_log_fn fn, void* user_data, int level);
void set_level(int level);
int level();

}  // namespace gradsync::log

#define GS_LOG_TRACE(...) ::gradsync::log::logger().trace(__VA_ARGS__)
#define GS_LOG_DEBUG(...) ::gradsync::log::logger().debug(__VA_ARGS__)
#define GS_LOG_INFO(...) ::gradsync::log::logger().info(__VA_ARGS__)
#define GS_LOG_WARN(...) ::gradsync::log::logger().warn(__VA_ARGS__)
#define GS_LOG_ERROR(...) ::gradsync::log::logger().error(__VA_ARGS__)
