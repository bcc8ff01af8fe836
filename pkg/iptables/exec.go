package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// DefaultTimeout bounds every iptables command. iptables-restore --wait can wait for the xtables
// lock without end; the timeout turns a stuck lock into a retried error.
const DefaultTimeout = 30 * time.Second

// Runner runs the iptables tools. The production Runner is ExecRunner; tests substitute an
// in-memory fake or an ExecRunner that enters a network namespace.
type Runner interface {
	// LookPath reports whether the named tool can be run, as exec.LookPath does.
	LookPath(name string) error
	// Run runs the tool with stdin as its input and returns its standard output. A tool that
	// exits non-zero returns an *ExecError carrying its standard error.
	Run(ctx context.Context, stdin []byte, name string, args ...string) ([]byte, error)
}

// ExecRunner runs the tools as child processes, never through a shell.
type ExecRunner struct {
	// Prefix is put before every command, e.g. {"ip", "netns", "exec", "NAME"} to act inside a
	// named network namespace. Empty runs the tool directly.
	Prefix []string
	// Timeout bounds each command; zero means DefaultTimeout.
	Timeout time.Duration
}

// LookPath implements Runner.
func (r ExecRunner) LookPath(name string) error {
	_, err := exec.LookPath(name)
	return err
}

// Run implements Runner.
func (r ExecRunner) Run(ctx context.Context, stdin []byte, name string, args ...string) ([]byte, error) {
	timeout := r.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	argv := append(append(append([]string(nil), r.Prefix...), name), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// A killed child may leave a grandchild holding the pipes; do not wait for it forever.
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return stdout.Bytes(), &ExecError{Command: strings.Join(append([]string{name}, args...), " "),
			Stderr: stderr.String(), Err: err}
	}
	return stdout.Bytes(), nil
}

// ExecError is a tool that failed. Its message carries the tool's own error lines.
type ExecError struct {
	Command string
	Stderr  string
	Err     error
}

func (e *ExecError) Error() string {
	if msg := toolMessage(e.Stderr); msg != "" {
		if strings.Contains(msg, lockFailure) {
			msg += lockHint
		}
		return fmt.Sprintf("%s: %s", e.Command, msg)
	}
	return fmt.Sprintf("%s: %v", e.Command, e.Err)
}

// lockFailure is how iptables-legacy says that it cannot take the xtables lock at all (not
// that another process holds it): "Fatal: can't open lock file /run/xtables.lock: Read-only
// file system", in a container without the node's lock file mounted.
const (
	lockFailure = "can't open lock file"
	lockHint    = " (iptables-legacy needs the node's xtables lock file, writable: mount the node's /run/xtables.lock, as the DaemonSet's xtables-lock volume does)"
)

func (e *ExecError) Unwrap() error { return e.Err }

// ExitCode is the tool's exit status; -1 when it did not exit (it could not start, or was
// killed).
func (e *ExecError) ExitCode() int {
	var exit interface{ ExitCode() int }
	if errors.As(e.Err, &exit) {
		return exit.ExitCode()
	}
	return -1
}

// toolMessage condenses a tool's standard error to its meaningful lines: iptables ends most
// errors with a usage hint that says nothing about the failure.
func toolMessage(stderr string) string {
	var lines []string
	for _, l := range strings.Split(stderr, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "Try `") {
			continue
		}
		lines = append(lines, l)
	}
	return strings.Join(lines, "; ")
}
