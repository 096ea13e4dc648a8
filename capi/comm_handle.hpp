#pragma once
// The object behind a gradsync_comm handle, shared by the shims that take a communicator
// (capi_comm.cpp, capi_shard.cpp).
#include <memory>

#include "capi/handle.hpp"
#include "comm/communicator.hpp"

struct gradsync_comm : gradsync::capi::Handle<gradsync::capi::Kind::Comm> {
  explicit gradsync_comm(std::unique_ptr<gradsync::comm::Communicator> c) : impl(std::move(c)) {}
  std::unique_ptr<gradsync::comm::Communicator> impl;
};
