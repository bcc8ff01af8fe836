package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestHeldNamespaceIsNotAnother is the teardown check's ground: a namespace deleted by name
// while held keeps its inode number, so a namespace made afterwards (the kernel hands freed
// numbers out again at once) is never taken for it. Before, the check knew the number alone,
// and a later test's etcd in a namespace with the same number was reported as this cluster's
// leftover.
func TestHeldNamespaceIsNotAnother(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "sleep")
	ctx := context.Background()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "ipmasq-t-held-" + hex.EncodeToString(b[:])
	if err := testutil.CreateNetns(ctx, name); err != nil {
		t.Fatal(err)
	}
	var h holder
	defer h.release()
	err := h.hold(netnsPath(name), "net")
	// A process in the held namespace is found.
	var p *Process
	if err == nil {
		p = sleepIn(t, netnsPath(name))
	}
	if derr := testutil.DeleteNetns(ctx, name); err == nil {
		err = derr
	}
	if err != nil {
		t.Fatal(err)
	}
	if pids, err := h.processes("/"+name, 0); err != nil || !slices.Contains(pids, p.Pid()) {
		t.Fatalf("processes in the held namespace: %v (%v), want %d among them", pids, err, p.Pid())
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	// Namespaces made now, each with a process in it, are none of the held one.
	reused := 0
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); {
		other := testutil.NewNetns(t)
		q := sleepIn(t, netnsPath(other))
		if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", q.Pid())); slices.Contains(h.links, l) {
			reused++
		}
		if pids, err := h.processes("/"+name, 0); err != nil || len(pids) > 0 {
			t.Fatalf("processes %v (%v) of namespaces made after the held one's deletion are taken for its", pids, err)
		}
	}
	if reused > 0 {
		t.Fatalf("%d namespaces got the held one's inode number", reused)
	}
}

// sleepIn runs sleep in the network namespace whose file is path until the test ends.
func sleepIn(t *testing.T, path string) *Process {
	t.Helper()
	p, err := startProcess("sleep", filepath.Join(t.TempDir(), "sleep.log"), Namespaces{Net: path}, nil, "sleep", "infinity")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Kill() })
	// nsenter execs sleep once it has entered: wait for that.
	if err := testutil.Poll(10*time.Second, 10*time.Millisecond, func() error {
		if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", p.Pid())); err != nil || filepath.Base(exe) != "sleep" {
			return testutil.NotYet("sleep to start: pid %d runs %s (%v)", p.Pid(), exe, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return p
}

// deadRunEnv makes TestReapDeadRun the dead run: a cluster of two nodes with a pod on each,
// killed with SIGKILL.
const deadRunEnv = "IPMASQ_K8S_DEAD_RUN"

// TestReapDeadRun kills a test binary whose two-node cluster runs a pod on each node, as go
// test's timeout does: the pods' processes and containerd's shims outlive it, with the nodes'
// network namespaces, the cgroups and the run directory. Reap, as the next run calls it,
// removes all of them, and leaves a live run alone.
func TestReapDeadRun(t *testing.T) {
	if os.Getenv(deadRunEnv) != "" {
		beDeadRun(t)
		return
	}
	Require(t)
	live := StartControlPlane(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestReapDeadRun$", "-test.v")
	cmd.Env = append(os.Environ(), deadRunEnv+"=1")
	runner := testutil.StartCmd(t, cmd)
	line, err := runner.WaitLine(3*time.Minute, "dead run: ")
	if err != nil {
		t.Fatalf("the dead run's cluster did not come up: %v", err)
	}
	dir := strings.TrimPrefix(line, "dead run: ")
	dead := run{dir: dir, id: strings.TrimPrefix(filepath.Base(dir), NetnsPrefix)}
	roles := []string{"cp", "node", "node-2", "out"}
	var node holder
	defer node.release()
	for _, role := range roles[1:3] {
		if err := node.hold(netnsPath(dead.netnsName(role)), "net"); err != nil {
			t.Fatal(err)
		}
	}
	// The runner alone, as go test's timeout kills a test binary: its cluster is left behind.
	if err := runner.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	pids, err := node.processes(dead.cgroupRoot(), 0)
	if err != nil || len(pids) == 0 {
		t.Fatalf("the dead run left no process (%v): nothing to reap", err)
	}
	t.Logf("the dead run left processes %v", pids)

	start := time.Now()
	reaped, err := Reap(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reaped %v in %v", reaped, time.Since(start).Round(time.Millisecond))
	if !slices.Contains(reaped, dead.id) || slices.Contains(reaped, live.run.id) {
		t.Errorf("reaped runs %v, want %s and not the live %s", reaped, dead.id, live.run.id)
	}
	if pids, err := node.processes(dead.cgroupRoot(), 0); err != nil || len(pids) > 0 {
		t.Errorf("processes of the dead run are left: %v (%v)", pids, err)
	}
	for _, role := range roles {
		if _, err := os.Lstat(netnsPath(dead.netnsName(role))); err == nil {
			t.Errorf("the dead run's network namespace %s is left", dead.netnsName(role))
		}
	}
	if dirs := cgroupDirs(dead.cgroupRoot()); len(dirs) > 0 {
		t.Errorf("the dead run's cgroups are left: %v", dirs)
	}
	if _, err := os.Lstat(dead.dir); err == nil {
		t.Errorf("the dead run's directory %s is left", dead.dir)
	}
	if _, err := live.Client.Discovery().ServerVersion(); err != nil {
		t.Errorf("the live run's API server: %v", err)
	}
}

// beDeadRun brings a cluster of two nodes up with a running pod on each, says where its run
// directory is and waits to be killed.
func beDeadRun(t *testing.T) {
	ctx := context.Background()
	c, err := New(ctx, ClusterOptions{Nodes: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes {
		pod := PausePod("p-"+n.Name, nil)
		pod.Spec.NodeName = n.Name
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.WaitPodRunning(ctx, "default", pod.Name); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Printf("dead run: %s\n", c.run.dir)
	time.Sleep(time.Hour)
}
