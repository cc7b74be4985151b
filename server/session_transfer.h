// The reactors of ExportSession (a snapshot out, in chunks) and ImportSession (chunks in, one
// snapshot) on gRPC's callback API; service.cc decides what goes out and what an upload means.
#ifndef SUBSPACE_SERVER_SESSION_TRANSFER_H_
#define SUBSPACE_SERVER_SESSION_TRANSFER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "proto/subspace.grpc.pb.h"

namespace subspace::server {

inline constexpr size_t kSnapshotChunkBytes = size_t{1} << 20;

// Writes `snapshot` in chunks of kSnapshotChunkBytes, then OK; a failed export's status alone.
grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* StartSnapshotExport(std::string snapshot);
grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* RejectSnapshotExport(
    const absl::Status& status);

// Reads every chunk (RESOURCE_EXHAUSTED past `max_bytes`, naming the limit), then finishes with
// `finish(all bytes)`. A non-OK `refused` answers at once without reading.
using SnapshotImportFinish = std::function<absl::Status(std::string bytes)>;
grpc::ServerReadReactor<v1::SessionSnapshotChunk>* StartSnapshotImport(
    uint64_t max_bytes, SnapshotImportFinish finish, const absl::Status& refused = {});

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_SESSION_TRANSFER_H_
