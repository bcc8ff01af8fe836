package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// oldest prepares the oldest kernel of the matrix, the one whose boot differs most from the
// host's (every boot module a module).
func oldest(t *testing.T) *Image {
	t.Helper()
	testutil.RequirePrivileged(t, Tools...)
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	img, err := Prepare(context.Background(), filepath.Join(root, "bin", "kernels"), Matrix[0])
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestRun: the guest runs the guest kernel, loads its modules on demand, runs the command in the
// directory and environment asked, on the host's files, and its output and exit code come back;
// what it writes stays in the guest.
func TestRun(t *testing.T) {
	img := oldest(t)
	dir := t.TempDir() // on the host: the guest sees it through the host's root
	if err := os.WriteFile(filepath.Join(dir, "from-host"), []byte("host file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	script := `set -e
test "$(uname -r)" = "$WANT_RELEASE" || { echo "kernel $(uname -r)"; exit 1; }
cat from-host
echo written > from-guest
ip netns add vmtest && ip -n vmtest link add va type veth peer name vb && ip netns del vmtest
lsmod | grep -q '^veth ' && echo veth loaded
echo "bpffs: $(stat -f -c %T /sys/fs/bpf)"
exit 3`
	res, err := img.Run(context.Background(), Command{
		Args: []string{"/bin/sh", "-c", script}, Dir: dir, Env: []string{"WANT_RELEASE=" + img.Release},
		Timeout: 5 * time.Minute, Output: &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s on %s in %v", img.Release, res.Accel, res.Took.Round(time.Millisecond))
	if res.ExitCode != 3 {
		t.Errorf("exit code %d, want 3; output:\n%s\nconsole:\n%s", res.ExitCode, res.Output, res.Console)
	}
	want := "host file\nveth loaded\nbpffs: bpf_fs\n"
	if out.String() != want || res.Output != want {
		t.Errorf("output %q (result %q), want %q", out.String(), res.Output, want)
	}
	if _, err := os.Stat(filepath.Join(dir, "from-guest")); !os.IsNotExist(err) {
		t.Errorf("the guest's write reached the host: %v", err)
	}
}

// TestRunTimeout: a command that does not end within the timeout ends the guest, with an error.
// A guest whose kernel dies before its command starts is booted once more, and the output says
// so: here the first boot's kernel finds no init and panics.
func TestRunBootsAgain(t *testing.T) {
	img := oldest(t)
	t.Setenv(AccelEnv, "tcg") // the first boot is the one that fails, not a KVM that cannot boot it
	kernelArgsOf = func(boot int) string {
		if boot == 1 {
			return "rdinit=/nonexistent init=/nonexistent"
		}
		return ""
	}
	defer func() { kernelArgsOf = nil }()
	var out strings.Builder
	res, err := img.Run(context.Background(), Command{Args: []string{"/bin/sh", "-c", "echo ran"}, Timeout: 5 * time.Minute, Output: &out})
	if err != nil || res.ExitCode != 0 || !strings.Contains(out.String(), "ran\n") {
		t.Fatalf("Run = %+v, %v; output:\n%s", res.ExitCode, err, out.String())
	}
	if !strings.Contains(out.String(), "died before its command started; booting it once more") {
		t.Errorf("the second boot is not told:\n%s", out.String())
	}
}

func TestRunTimeout(t *testing.T) {
	img := oldest(t)
	start := time.Now()
	_, err := img.Run(context.Background(), Command{Args: []string{"sleep", "600"}, Timeout: 20 * time.Second})
	if err == nil || !strings.Contains(err.Error(), "did not end within 20s") {
		t.Fatalf("Run = %v, want the timeout", err)
	}
	if took := time.Since(start); took > 2*time.Minute {
		t.Errorf("the guest was ended after %v", took)
	}
}

// killedRunnerEnv makes TestKilledRunnerLeavesNothing the runner it kills.
const killedRunnerEnv = "VM_TEST_KILLED_RUNNER"

// TestKilledRunnerLeavesNothing: a test binary killed while its guest runs (as go test's -timeout
// does) takes the guest with it, and its run directory goes with the next run.
func TestKilledRunnerLeavesNothing(t *testing.T) {
	img := oldest(t)
	if os.Getenv(killedRunnerEnv) != "" {
		_, err := img.Run(context.Background(), Command{Args: []string{"/bin/sh", "-c", "echo up; sleep 600"},
			Timeout: 15 * time.Minute, Output: os.Stdout})
		t.Fatalf("the guest ended (%v); the test should have been killed", err)
	}
	before, _ := filepath.Glob(filepath.Join(os.TempDir(), runDirPrefix+"*"))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestKilledRunnerLeavesNothing$", "-test.v")
	cmd.Env = append(os.Environ(), killedRunnerEnv+"=1")
	runner := testutil.StartCmd(t, cmd)
	if _, err := runner.WaitLine(5*time.Minute, "up"); err != nil {
		t.Fatalf("the runner's guest did not start: %v", err)
	}
	after, _ := filepath.Glob(filepath.Join(os.TempDir(), runDirPrefix+"*"))
	var runs []string
	for _, d := range after {
		if !slices.Contains(before, d) {
			runs = append(runs, d)
		}
	}
	if len(runs) != 1 {
		t.Fatalf("run directories made by the runner: %v, want one", runs)
	}
	run := runs[0]
	if qemuOf(run) == 0 {
		t.Fatalf("no QEMU runs with %s", run)
	}
	if err := runner.Kill(ctx); err != nil { // the runner alone, not its process group with QEMU
		t.Fatal(err)
	}
	if err := testutil.Poll(30*time.Second, 100*time.Millisecond, func() error {
		if pid := qemuOf(run); pid != 0 {
			return testutil.NotYet("QEMU (pid %d) still runs", pid)
		}
		return nil
	}); err != nil {
		pid := qemuOf(run)
		if p, err := os.FindProcess(pid); err == nil {
			p.Kill()
		}
		os.RemoveAll(run)
		t.Fatalf("QEMU (pid %d) outlived its runner by 30 s", pid)
	}
	if _, err := os.Stat(run); err != nil {
		t.Fatalf("the killed runner's directory: %v, want it left (nothing ran to remove it)", err)
	}
	old := time.Now().Add(-2 * time.Minute)
	if err := os.Chtimes(run, old, old); err != nil {
		t.Fatal(err)
	}
	removeStaleRunDirs()
	if _, err := os.Stat(run); !os.IsNotExist(err) {
		os.RemoveAll(run)
		t.Errorf("the next run left the killed runner's directory: %v", err)
	}
}

// qemuOf is the pid of the QEMU whose command line names run, 0 where there is none.
func qemuOf(run string) int {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), run) || !strings.HasPrefix(string(b), "qemu-system") {
			continue
		}
		var pid int
		if _, err := fmt.Sscanf(p, "/proc/%d/cmdline", &pid); err == nil {
			return pid
		}
	}
	return 0
}

// TestModuleOrder: boot modules come after what they depend on, built-in ones are left out, and
// an unknown one is an error.
func TestModuleOrder(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("modules.dep", "kernel/fs/9p/9p.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/fs/netfs/netfs.ko.xz\n"+
		"kernel/net/9p/9pnet.ko.xz:\nkernel/fs/netfs/netfs.ko.xz:\n"+
		"kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/drivers/virtio/virtio_ring.ko.xz\n"+
		"kernel/drivers/virtio/virtio_ring.ko.xz:\n")
	write("modules.builtin", "kernel/drivers/virtio/virtio_pci.ko\n")
	got, err := moduleOrder(dir, []string{"virtio_pci", "9pnet_virtio", "9p"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"kernel/net/9p/9pnet.ko.xz", "kernel/drivers/virtio/virtio_ring.ko.xz", "kernel/net/9p/9pnet_virtio.ko.xz",
		"kernel/fs/netfs/netfs.ko.xz", "kernel/fs/9p/9p.ko.xz"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("order %v, want %v", got, want)
	}
	if _, err := moduleOrder(dir, []string{"overlay"}); err == nil {
		t.Error("an unknown module was accepted")
	}
}

// TestDebianMirror: the mirror of sources.list lines and deb822 URIs.
func TestDebianMirror(t *testing.T) {
	for line, want := range map[string]string{
		"deb http://deb.debian.org/debian bookworm main":                                "http://deb.debian.org/debian",
		"deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main": "http://mirror.example/debian",
		"URIs: http://proxy.example:3142/debian":                                        "http://proxy.example:3142/debian",
		"URIs: http://deb.debian.org/debian-security":                                   "",
		"deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main":             "",
	} {
		got := ""
		if m := mirrorLine.FindStringSubmatch(line); m != nil {
			got = m[1]
		}
		if got != want {
			t.Errorf("%q: mirror %q, want %q", line, got, want)
		}
	}
}
