package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// Process is one component of the cluster (etcd, the API server, ...) running inside the
// cluster's namespaces, its output in a log file.
type Process struct {
	// Name names it in errors and is its log file's base name.
	Name string
	// Log is the file its standard output and error go to.
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // exit status, valid once done is closed
}

// Namespaces are the namespaces a process is started in: each a path to a namespace file
// (/run/netns/NAME, /proc/PID/ns/mnt, /proc/PID/ns/uts); empty keeps the caller's.
type Namespaces struct {
	Net, Mount, UTS string
}

// nsenter prefixes argv with the nsenter call that enters ns, which execs argv in place, so
// the process's pid is the component's.
func (ns Namespaces) nsenter(argv []string) []string {
	var pre []string
	if ns.Net != "" {
		pre = append(pre, "--net="+ns.Net)
	}
	if ns.Mount != "" {
		pre = append(pre, "--mount="+ns.Mount)
	}
	if ns.UTS != "" {
		pre = append(pre, "--uts="+ns.UTS)
	}
	if len(pre) == 0 {
		return argv
	}
	return append(append(append([]string{"nsenter"}, pre...), "--"), argv...)
}

// Command is an exec.Cmd that runs argv inside ns, ended by ctx.
func (ns Namespaces) Command(ctx context.Context, argv ...string) *exec.Cmd {
	full := ns.nsenter(argv)
	cmd := exec.CommandContext(ctx, full[0], full[1:]...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// Run runs argv inside ns and returns its output, failing with what it printed.
func (ns Namespaces) Run(ctx context.Context, timeout time.Duration, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := ns.Command(ctx, argv...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// startProcess runs argv inside ns with its output appended to logPath. The process gets a
// process group of its own, and the kernel kills it if this process dies first.
func startProcess(name, logPath string, ns Namespaces, env []string, argv ...string) (*Process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	full := ns.nsenter(argv)
	cmd := exec.Command(full[0], full[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p := &Process{Name: name, Log: logPath, done: make(chan struct{})}
	// The kernel sends Pdeathsig when the forking *thread* exits, so fork from a thread locked
	// for the process's whole life.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("start %s: %w", name, err)
			return
		}
		started <- nil
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	p.cmd = cmd
	return p, nil
}

// Pid is the process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Stop sends SIGTERM, waits up to grace for the exit, then kills the process group. A process
// that had already exited is not an error: Stop is also teardown.
func (p *Process) Stop(grace time.Duration) error {
	if exited, _ := p.Exited(); exited {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	return p.Kill()
}

// Kill kills the process group and waits for the exit.
func (p *Process) Kill() error {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s (pid %d) did not die", p.Name, p.Pid())
	}
}

// Tail is the last n lines of the process's log.
func (p *Process) Tail(n int) string {
	b, err := os.ReadFile(p.Log)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// errExited says a process ended while it was being waited for.
var errExited = errors.New("exited")

// alive fails when the process has ended, with the end of its log.
func (p *Process) alive() error {
	if exited, err := p.Exited(); exited {
		return fmt.Errorf("%s %w (%v); its log ends:\n%s", p.Name, errExited, err, p.Tail(30))
	}
	return nil
}
