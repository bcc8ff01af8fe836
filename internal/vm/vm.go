package vm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Tools are the host's commands that Prepare and Run use (test/deps.sh installs them).
var Tools = []string{"qemu-system-x86_64", "apt-get", "dpkg-deb", "depmod", "cpio", "xz", busybox}

// Command is what Run runs in the guest.
type Command struct {
	// Args is the command line; Args[0] a path on the host's root (the guest sees the same).
	Args []string
	// Dir is the directory it starts in; empty is /.
	Dir string
	// Env is its environment, on top of PATH and HOME; CI is passed on from the host's.
	Env []string
	// Timeout ends the guest, and the run with an error; zero is DefaultTimeout.
	Timeout time.Duration
	// Output receives the command's output (standard output and error) as it comes; nil drops
	// it (Result.Output keeps the end).
	Output io.Writer
	// Memory is the guest's memory in MiB, CPUs its processors; zero is the defaults.
	Memory, CPUs int
}

// Defaults of Command.
const (
	DefaultTimeout = 30 * time.Minute
	DefaultMemory  = 4096
)

// Result is what a run left.
type Result struct {
	// ExitCode is the command's exit status.
	ExitCode int
	// Output is the end of the command's output, Console the end of what the guest printed on
	// its console (the kernel's messages, init's), for errors.
	Output, Console string
	// Accel is the accelerator the guest ran on: kvm or tcg.
	Accel string
	// Took is the time from the start of QEMU to the guest's end.
	Took time.Duration
}

// AccelEnv forces an accelerator (kvm or tcg) instead of the choice Run makes.
const AccelEnv = "VM_ACCEL"

// Run boots img and runs c in it: the host's root filesystem read-only under a tmpfs (writes
// stay in the guest; /run starts empty), the guest's modules at /lib/modules, a BPF filesystem, cgroup2, and no
// network device. The error is about the run (QEMU failed, the guest ended without an exit
// code, the timeout); the command's own failure is Result.ExitCode.
//
// KVM is used where /dev/kvm boots the kernel; where it does not (a nested KVM that runs only
// its own kind of guest), QEMU fails before the guest starts, and Run falls back to TCG, for this
// run and every later one of the process.
func (img *Image) Run(ctx context.Context, c Command) (Result, error) {
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	accel := chooseAccel()
	boots := 1
	res, started, err := img.boot(ctx, c, accel, boots)
	if accel == "kvm" && !started && ctx.Err() == nil {
		kvmFailed.Store(true)
		accel, boots = "tcg", boots+1
		res, started, err = img.boot(ctx, c, accel, boots)
	}
	// A guest that died before its command started ran none of it: its kernel failed to boot.
	// Under TCG that happens now and then (6.12 once hit an int3 of its own text patching in
	// sched_clock_cpu and panicked in init): boot it once more, and say so.
	if !started && err != nil && ctx.Err() == nil {
		fmt.Fprintf(orDiscard(c.Output), "vm: the guest (%s, %s) died before its command started; booting it once more. Its console ended:\n%s\n",
			img.Name, accel, testutil.LastLines(res.Console, 10))
		res, _, err = img.boot(ctx, c, accel, boots+1)
	}
	return res, err
}

// kernelArgsOf, when set (by a test), adds to the kernel's command line of the boot-th boot of a
// Run.
var kernelArgsOf func(boot int) string

// kvmFailed is set once a guest failed to start on KVM: later runs take TCG at once.
var kvmFailed atomic.Bool

// chooseAccel is AccelEnv, else kvm where /dev/kvm opens and has not failed a boot, else tcg.
func chooseAccel() string {
	if a := os.Getenv(AccelEnv); a != "" {
		return a
	}
	if kvmFailed.Load() {
		return "tcg"
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return "tcg"
	}
	f.Close()
	return "kvm"
}

// boot runs c in one guest on accel, the boot-th of its Run; started tells whether the guest got
// as far as the command.
func (img *Image) boot(ctx context.Context, c Command, accel string, boot int) (res Result, started bool, err error) {
	res.Accel = accel
	// Pdeathsig (below) follows the thread that started QEMU, not the process: this one stays.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	run, release, err := newRunDir()
	if err != nil {
		return res, false, err
	}
	defer release()
	if err := os.WriteFile(filepath.Join(run, "cmd"), []byte(script(c)), 0o644); err != nil {
		return res, false, err
	}
	// The guest writes its output there; created here so that following it starts at once.
	if err := os.WriteFile(filepath.Join(run, "output"), nil, 0o666); err != nil {
		return res, false, err
	}

	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	var console tail
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", img.qemuArgs(c, accel, run, boot)...)
	cmd.Stdout, cmd.Stderr = &console, &console
	cmd.WaitDelay = 5 * time.Second
	// A guest takes gigabytes and every CPU: it must not outlive a test binary killed by its
	// -timeout, which no deferred cancel survives.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return res, false, fmt.Errorf("start qemu: %w", err)
	}
	out := tail{max: 64 << 10}
	followed := make(chan struct{})
	stop := make(chan struct{})
	go func() {
		defer close(followed)
		follow(filepath.Join(run, "output"), io.MultiWriter(&out, orDiscard(c.Output)), stop)
	}()
	werr := cmd.Wait()
	close(stop)
	<-followed
	res.Took = time.Since(start)
	res.Output, res.Console = out.String(), console.String()
	_, serr := os.Stat(filepath.Join(run, "started"))
	started = serr == nil
	if ctx.Err() != nil {
		return res, started, fmt.Errorf("the guest (%s, %s) did not end within %v; its console:\n%s",
			img.Name, accel, c.Timeout, testutil.LastLines(res.Console, 30))
	}
	rc, rerr := os.ReadFile(filepath.Join(run, "rc"))
	if rerr != nil {
		return res, started, fmt.Errorf("the guest (%s, %s) ended without the command's exit code (qemu: %v); its console:\n%s",
			img.Name, accel, werr, testutil.LastLines(res.Console, 30))
	}
	res.ExitCode, err = strconv.Atoi(strings.TrimSpace(string(rc)))
	return res, started, err
}

// runDirPrefix names the run directories in the temporary directory.
const runDirPrefix = "ip-masq-agent-vm-"

// newRunDir makes the directory of one boot (the command, its output and exit code, which the
// guest reaches through the host's root) and holds a lock on it until release, which removes it.
// A killed runner cannot remove its own: the directories whose lock nobody holds go first.
func newRunDir() (dir string, release func(), err error) {
	removeStaleRunDirs()
	dir, err = os.MkdirTemp("", runDirPrefix)
	if err != nil {
		return "", nil, err
	}
	unlock, err := lock(filepath.Join(dir, "lock"), false)
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	return dir, func() { os.RemoveAll(dir); unlock() }, nil
}

// removeStaleRunDirs removes the run directories of runners that died (their lock free). One
// made in the last minute is left alone: its runner may not have locked it yet.
func removeStaleRunDirs() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), runDirPrefix+"*"))
	for _, d := range dirs {
		if fi, err := os.Stat(d); err != nil || time.Since(fi.ModTime()) < time.Minute {
			continue
		}
		if unlock, err := lock(filepath.Join(d, "lock"), false); err == nil {
			os.RemoveAll(d)
			unlock()
		}
	}
}

// qemuArgs boots img with the host's root (hostroot), the kernel's modules (modules) and the
// run directory (run) shared over virtio-9p, the serial console on standard output, and no
// network.
func (img *Image) qemuArgs(c Command, accel, run string, boot int) []string {
	mem, cpus := c.Memory, c.CPUs
	if mem == 0 {
		mem = DefaultMemory
	}
	if cpus == 0 {
		cpus = runtime.NumCPU()
	}
	cpu := "max"
	if accel == "kvm" {
		cpu = "host"
	} else {
		// Several host threads for the guest's processors (multi-threaded TCG).
		accel += ",thread=multi"
	}
	share := func(path, tag string, ro bool) []string {
		opt := "local,path=" + path + ",mount_tag=" + tag + ",security_model=none,multidevs=remap"
		if ro {
			opt += ",readonly=on"
		}
		return []string{"-virtfs", opt}
	}
	args := []string{
		"-nodefaults", "-nographic", "-no-reboot",
		"-accel", accel, "-cpu", cpu, "-smp", strconv.Itoa(cpus), "-m", strconv.Itoa(mem),
		"-kernel", img.Vmlinuz, "-initrd", img.Initramfs,
		// panic=-1: a panic powers off at once (with -no-reboot), rather than hanging.
		"-append", "console=ttyS0 panic=-1 quiet loglevel=4" + extraKernelArgs(boot),
		"-serial", "stdio", "-nic", "none",
		"-device", "virtio-rng-pci",
	}
	args = append(args, share("/", "hostroot", true)...)
	args = append(args, share(img.Modules, "modules", true)...)
	return append(args, share(run, "run", false)...)
}

func extraKernelArgs(boot int) string {
	if kernelArgsOf == nil {
		return ""
	}
	return " " + kernelArgsOf(boot)
}

// script is the guest's /run/vm/cmd: the environment, the directory, then c's command.
func script(c Command) string {
	var b strings.Builder
	b.WriteString("export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n")
	if ci := os.Getenv("CI"); ci != "" {
		fmt.Fprintf(&b, "export CI=%s\n", quote(ci))
	}
	for _, kv := range c.Env {
		k, v, _ := strings.Cut(kv, "=")
		fmt.Fprintf(&b, "export %s=%s\n", k, quote(v))
	}
	dir := c.Dir
	if dir == "" {
		dir = "/"
	}
	fmt.Fprintf(&b, "cd %s || exit 125\n", quote(dir))
	quoted := make([]string, len(c.Args))
	for i, a := range c.Args {
		quoted[i] = quote(a)
	}
	fmt.Fprintf(&b, "exec %s\n", strings.Join(quoted, " "))
	return b.String()
}

// quote quotes s for the shell.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// follow copies what is appended to the file at path to w until stop is closed, then the rest.
func follow(path string, w io.Writer, stop <-chan struct{}) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		io.Copy(w, f)
		select {
		case <-stop:
			io.Copy(w, f)
			return
		case <-tick.C:
		}
	}
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// tail keeps the last max bytes written to it (256 KiB when max is 0).
type tail struct {
	mu  sync.Mutex
	buf bytes.Buffer
	max int
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	limit := t.max
	if limit == 0 {
		limit = 256 << 10
	}
	t.buf.Write(p)
	if over := t.buf.Len() - limit; over > 0 {
		t.buf.Next(over)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.buf.String()
}
