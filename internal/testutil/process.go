package testutil

import (
	"context"
	"fmt"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Process is a program a test started, in a process group of its own, its standard output and
// error collected together. The kernel kills it if the test binary dies first.
type Process struct {
	cmd  *exec.Cmd
	out  Buffer
	done chan struct{}
	err  error // exit status, valid once done is closed
}

// tailLines is how many of the last lines of a process's output its errors carry.
const tailLines = 20

// Start runs name with args for the test, until ctx ends or the test does (StartCmd).
func Start(ctx context.Context, t testing.TB, name string, args ...string) *Process {
	t.Helper()
	return StartCmd(t, exec.CommandContext(ctx, name, args...))
}

// StartCmd starts cmd, which the caller prepared (its environment, directory, credentials),
// bound to the test: when the test ends the process is killed with its process group, and if
// the test failed what it wrote is logged.
func StartCmd(t testing.TB, cmd *exec.Cmd) *Process {
	t.Helper()
	p, err := Spawn(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.KillGroup(10 * time.Second); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("%s wrote:\n%s", p, p.Logs())
		}
	})
	return p
}

// Spawn starts cmd bound to no test: the caller ends it (Stop, Kill, KillGroup). Its standard
// output and error go to Logs, it gets a process group of its own (so that KillGroup ends what
// it started too), and the kernel kills it if this process dies first: the rest of a
// SysProcAttr of the caller's (credentials, clone flags) is kept, but not Setsid, which a
// process group of its own excludes.
func Spawn(cmd *exec.Cmd) (*Process, error) {
	p := &Process{cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if cmd.WaitDelay == 0 {
		cmd.WaitDelay = 2 * time.Second
	}
	// The kernel sends Pdeathsig when the forking *thread* exits, and Go ends threads whose
	// goroutine exits while locked (as Do's do). So fork from a thread of our own, locked until
	// the process is gone.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("start %s: %w", strings.Join(cmd.Args, " "), err)
	}
	return p, nil
}

// String is the process's command line and pid.
func (p *Process) String() string {
	return fmt.Sprintf("%s (pid %d)", strings.Join(p.cmd.Args, " "), p.Pid())
}

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Logs returns what the process wrote so far, standard output and error together.
func (p *Process) Logs() string { return p.out.String() }

// Exited reports whether the process ended, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Wait waits for the process to exit and returns its exit status, with the end of its output
// when it failed.
func (p *Process) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		if p.err != nil {
			return p.failed(p.err)
		}
		return nil
	case <-ctx.Done():
		return p.failed(fmt.Errorf("still running: %w", ctx.Err()))
	}
}

// Stop sends SIGTERM and waits for the exit; the error is the exit status (Wait).
func (p *Process) Stop(ctx context.Context) error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return fmt.Errorf("signal pid %d: %w", p.Pid(), err)
	}
	if err := p.Wait(ctx); err != nil {
		return fmt.Errorf("after SIGTERM: %w", err)
	}
	return nil
}

// Kill sends SIGKILL and waits for the exit; the error says only that the process did not end.
func (p *Process) Kill(ctx context.Context) error {
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill pid %d: %w", p.Pid(), err)
	}
	if err := p.Wait(ctx); ctx.Err() != nil {
		return err
	}
	return nil
}

// KillGroup kills the process with its process group and waits, at most timeout, for its exit.
func (p *Process) KillGroup(timeout time.Duration) error {
	_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("pid %d did not die within %v of SIGKILL", p.Pid(), timeout)
	}
}

// WaitLine waits, at most within, until the process wrote a whole line that starts with
// prefix, and returns it (without its newline). It fails at once if the process ends first.
func (p *Process) WaitLine(within time.Duration, prefix string) (string, error) {
	var line string
	err := Poll(within, 10*time.Millisecond, func() error {
		exited, status := p.Exited() // before the output, which is whole once it exited
		for l := range strings.Lines(p.Logs()) {
			if strings.HasPrefix(l, prefix) && strings.HasSuffix(l, "\n") {
				line = strings.TrimSuffix(l, "\n")
				return nil
			}
		}
		if exited {
			return fmt.Errorf("exited (%v) before a line starting with %q", status, prefix)
		}
		return NotYet("a line starting with %q", prefix)
	})
	if err != nil {
		return "", p.failed(err)
	}
	return line, nil
}

// failed is err about the process, with the end of its output.
func (p *Process) failed(err error) error {
	out := LastLines(p.Logs(), tailLines)
	if out == "" {
		return fmt.Errorf("pid %d: %w; it wrote nothing", p.Pid(), err)
	}
	return fmt.Errorf("pid %d: %w; its output ends:\n%s", p.Pid(), err, out)
}
