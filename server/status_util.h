// Conversions between core's plain types and the wire: absl::Status to grpc::Status (the codes
// are the same numbers, so the mapping is one-to-one) and core finish reasons to the proto enum.
#ifndef SUBSPACE_SERVER_STATUS_UTIL_H_
#define SUBSPACE_SERVER_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "proto/subspace.pb.h"

namespace subspace::server {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kDeadline:
      return v1::FINISH_REASON_DEADLINE;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// The status a finished request ends with: the engine's own failure if any, otherwise
// CANCELLED / DEADLINE_EXCEEDED for those finish reasons and OK for the rest.
inline absl::Status FinishStatus(const GenerateResult& result) {
  if (!result.status.ok()) return result.status;
  if (result.finish == FinishReason::kCancelled) {
    return absl::CancelledError("the request was cancelled");
  }
  if (result.finish == FinishReason::kDeadline) {
    return absl::DeadlineExceededError("the request's deadline passed before it finished");
  }
  return absl::OkStatus();
}

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_STATUS_UTIL_H_
