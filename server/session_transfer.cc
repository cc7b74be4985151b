#include "server/session_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "server/status_util.h"

namespace subspace::server {
namespace {

class ExportReactor final : public grpc::ServerWriteReactor<v1::SessionSnapshotChunk> {
 public:
  ExportReactor(std::string snapshot, const absl::Status& status) : snapshot_(std::move(snapshot)) {
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (pos_ >= snapshot_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const size_t n = std::min(kSnapshotChunkBytes, snapshot_.size() - pos_);
    chunk_.set_data(snapshot_.substr(pos_, n));
    pos_ += n;
    StartWrite(&chunk_);
  }

  const std::string snapshot_;
  size_t pos_ = 0;
  v1::SessionSnapshotChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::SessionSnapshotChunk> {
 public:
  ImportReactor(uint64_t max_bytes, SnapshotImportFinish finish, const absl::Status& refused)
      : max_bytes_(max_bytes), finish_(std::move(finish)) {
    if (!refused.ok()) {
      Finish(ToGrpcStatus(refused));
      return;
    }
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the client's last chunk (or a cancelled call: Finish is then ignored)
      Finish(ToGrpcStatus(finish_(std::move(bytes_))));
      return;
    }
    if (bytes_.size() + chunk_.data().size() > max_bytes_) {
      Finish(ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrFormat("the snapshot passes this server's limit of %d bytes", max_bytes_))));
      return;
    }
    bytes_ += chunk_.data();
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  const uint64_t max_bytes_;
  const SnapshotImportFinish finish_;
  std::string bytes_;
  v1::SessionSnapshotChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* StartSnapshotExport(std::string snapshot) {
  return new ExportReactor(std::move(snapshot), absl::OkStatus());
}

grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* RejectSnapshotExport(
    const absl::Status& status) {
  return new ExportReactor({}, status);
}

grpc::ServerReadReactor<v1::SessionSnapshotChunk>* StartSnapshotImport(
    uint64_t max_bytes, SnapshotImportFinish finish, const absl::Status& refused) {
  return new ImportReactor(max_bytes, std::move(finish), refused);
}

}  // namespace subspace::server
