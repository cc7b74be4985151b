// A real subspace-server (or any program that prints "... port P, ..." as its first stdout line)
// as a child process, for the tests that need the binary itself: SIGTERM drain and the soak.
// Started with posix_spawn (no fork handlers run in a process full of gRPC threads), its stderr
// kept in a file the test can read after it exits, and SIGKILLed by the destructor if the test
// leaves it running, so a failed test never leaks a server.
#ifndef SUBSPACE_TESTS_SERVER_SERVER_PROCESS_H_
#define SUBSPACE_TESTS_SERVER_SERVER_PROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace subspace::testing {

class ServerProcess {
 public:
  // Runs `argv` (argv[0] is the binary) and waits up to `start_timeout` for its first stdout
  // line, which must name the gRPC port ("subspace-server listening on port P, ...").
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(std::vector<std::string> argv,
                                                              absl::Duration start_timeout) {
    std::unique_ptr<ServerProcess> p(new ServerProcess());
    static int serial = 0;
    p->stderr_path_ =
        absl::StrCat(::testing::TempDir(), "/server_stderr_", getpid(), "_", serial++, ".log");
    int out_pipe[2];
    if (pipe(out_pipe) != 0) return absl::InternalError("pipe failed");
    const int err_fd = open(p->stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (err_fd < 0) return absl::InternalError(absl::StrCat("cannot open ", p->stderr_path_));
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err_fd, STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, out_pipe[0]);
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out_pipe[1]);
    close(err_fd);
    if (rc != 0) {
      close(out_pipe[0]);
      return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], " failed: ", rc));
    }
    p->pid_ = pid;
    p->stdout_fd_ = out_pipe[0];

    // The first line, read with a deadline so a server that never comes up fails the test.
    std::string line;
    const absl::Time deadline = absl::Now() + start_timeout;
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return absl::DeadlineExceededError("the server printed no port in time");
      pollfd pfd{p->stdout_fd_, POLLIN, 0};
      if (poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1000))) <= 0) continue;
      char c;
      if (read(p->stdout_fd_, &c, 1) != 1) {
        return absl::InternalError(
            absl::StrCat("the server exited before listening:\n", p->ReadStderr()));
      }
      if (c == '\n') break;
      line += c;
    }
    p->line_ = line;
    p->port_ = p->PortAfter("port ");
    if (p->port_ <= 0) return absl::InternalError(absl::StrCat("no port in \"", line, "\""));
    return p;
  }

  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    // Kept open until now: a server writing to a closed stdout would die of SIGPIPE.
    if (stdout_fd_ >= 0) close(stdout_fd_);
    std::remove(stderr_path_.c_str());
  }

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  // The first stdout line ("subspace-server listening on port P, metrics port M, http port H").
  const std::string& line() const { return line_; }
  // The number after `label` in it ("metrics port "); -1 when absent.
  int PortAfter(const std::string& label) const {
    const size_t at = line_.find(label);
    if (at == std::string::npos) return -1;
    const size_t from = at + label.size();
    const size_t comma = line_.find(',', from);
    int value = -1;
    if (!absl::SimpleAtoi(
            line_.substr(from, comma == std::string::npos ? std::string::npos : comma - from),
            &value)) {
      return -1;
    }
    return value;
  }

  bool Signal(int sig) const { return pid_ > 0 && !exited_ && kill(pid_, sig) == 0; }

  // The wait status once the process exits; DEADLINE_EXCEEDED if it is still running after
  // `timeout` (it is then SIGKILLed, so the test never leaves it behind).
  absl::StatusOr<int> WaitExit(absl::Duration timeout) {
    if (exited_) return wait_status_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        wait_status_ = status;
        return status;
      }
      if (r < 0) return absl::InternalError("waitpid failed");
      if (absl::Now() >= deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        exited_ = true;
        wait_status_ = status;
        return absl::DeadlineExceededError("the process did not exit in time; killed");
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // Everything the process wrote to stderr so far.
  std::string ReadStderr() const {
    std::ifstream in(stderr_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  ServerProcess() = default;

  pid_t pid_ = -1;
  int port_ = 0;
  std::string line_;
  int stdout_fd_ = -1;
  std::string stderr_path_;
  bool exited_ = false;
  int wait_status_ = 0;
};

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_SERVER_SERVER_PROCESS_H_
