// The gRPC listener's transport security: plaintext, TLS from a PEM certificate and key, or
// mutual TLS that also requires a client certificate signed by a given CA. The files are read
// and checked once at start, so a bad one stops the server with a message naming its flag.
#ifndef SUBSPACE_SERVER_TLS_H_
#define SUBSPACE_SERVER_TLS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace subspace::server {

struct TlsConfig {
  std::string cert_path;  // PEM certificate chain, leaf first; empty (with key_path): plaintext
  std::string key_path;   // PEM private key of the leaf certificate
  std::string client_ca_path;  // PEM CA bundle; set: clients must present a certificate it signed
};

// True when `config` asks for TLS at all.
inline bool TlsEnabled(const TlsConfig& config) {
  return !config.cert_path.empty() || !config.key_path.empty() || !config.client_ca_path.empty();
}

// Insecure credentials when TLS is off; otherwise TLS (mTLS with client_ca_path) from the files.
// INVALID_ARGUMENT naming the flag (--tls-cert, --tls-key, --tls-client-ca) when one of the pair
// is missing, a client CA comes without a certificate, a file cannot be read or holds no
// certificate (no key), or the key does not belong to the certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsConfig& config);

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_TLS_H_
