// Server credentials from PEM files. gRPC only finds out a file is bad when the listener is
// built, and then reports it in its own log as a failure to listen; OpenSSL parses the files
// here first so the message names the flag and what is wrong with it.
#include "server/tls.h"

#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace subspace::server {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  if (in.is_open()) bytes << in.rdbuf();
  if (!in.is_open() || in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  }
  return bytes.str();
}

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of `pem`, or null.
X509Ptr FirstCertificate(const std::string& pem) {
  BioPtr bio = MemoryBio(pem);
  X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  ERR_clear_error();
  return cert;
}

// An encrypted key would make OpenSSL ask for a passphrase on the terminal; gRPC cannot use
// one anyway, so it reads as no key.
int NoPassphrase(char*, int, int, void*) { return 0; }

KeyPtr PrivateKey(const std::string& pem) {
  BioPtr bio = MemoryBio(pem);
  KeyPtr key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr) : nullptr);
  ERR_clear_error();
  return key;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsConfig& config) {
  if (!TlsEnabled(config)) return grpc::InsecureServerCredentials();
  if (config.cert_path.empty() != config.key_path.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  if (config.cert_path.empty()) {  // only a client CA
    return absl::InvalidArgumentError(
        "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)");
  }
  absl::StatusOr<std::string> cert_pem = ReadFile(config.cert_path, "--tls-cert");
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFile(config.key_path, "--tls-key");
  if (!key_pem.ok()) return key_pem.status();
  X509Ptr cert = FirstCertificate(*cert_pem);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: ", config.cert_path, " holds no PEM certificate"));
  }
  KeyPtr key = PrivateKey(*key_pem);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: ", config.key_path, " holds no PEM private key (or only an encrypted one)"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", config.key_path,
                                                   " is not the key of the certificate in ",
                                                   config.cert_path));
  }

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back(
      {.private_key = *std::move(key_pem), .cert_chain = *std::move(cert_pem)});
  if (!config.client_ca_path.empty()) {
    absl::StatusOr<std::string> ca_pem = ReadFile(config.client_ca_path, "--tls-client-ca");
    if (!ca_pem.ok()) return ca_pem.status();
    if (FirstCertificate(*ca_pem) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-client-ca: ", config.client_ca_path, " holds no PEM certificate"));
    }
    options.pem_root_certs = *std::move(ca_pem);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace subspace::server
