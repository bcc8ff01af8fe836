package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// The node's processes (containerd, the kubelet, kube-proxy and every container they start) run
// in a mount namespace of their own, so the host paths they insist on are that namespace's
// mounts and vanish with it:
//
//   - /run is a fresh tmpfs: containerd's socket and state, runc's state, the pods' network
//     namespace files, the xtables lock;
//   - /var/lib and /var/log are bind mounts of the node's directory: the kubelet's root (its
//     device-plugins socket folder included), containerd's store, host-local's leases, the
//     pods' and containers' logs;
//   - /sys is a sysfs of the node's network namespace (as `ip netns exec` mounts one), with the
//     host's cgroup hierarchies bound back under it and a BPF filesystem of the node's own, so
//     no pin lands in the host's;
//   - the kernel settings the kubelet would otherwise write for the whole machine
//     (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops, ...) read as the values it
//     wants, from files bound over them.
//
// Everything is made shared inside the namespace, as on a systemd host, so that the agent's
// HostToContainer bpffs mount is accepted; the namespace starts private, so nothing propagates
// to the host.

// kubeletSysctls are the kernel settings the kubelet's container manager checks (and, unless
// told to protect kernel defaults, writes), with the values it wants.
var kubeletSysctls = map[string]string{
	"vm/overcommit_memory":      "1",
	"vm/panic_on_oom":           "0",
	"kernel/panic":              "10",
	"kernel/panic_on_oops":      "1",
	"kernel/keys/root_maxkeys":  "1000000",
	"kernel/keys/root_maxbytes": "25000000",
}

// The holder also holds the node's UTS namespace, whose host name is the node's: a hostNetwork
// pod shares it, as it shares a real node's, and answers with the node's name (the e2e tests'
// netservers do).

// mountNamespace is the node's mount (and UTS) namespace, held by a process that does nothing
// else.
type mountNamespace struct {
	holder *Process
	dir    string
}

// path is the namespace's file, for nsenter.
func (m *mountNamespace) path() string { return "/proc/" + strconv.Itoa(m.holder.Pid()) + "/ns/mnt" }

// utsPath is the node's UTS namespace's file, for nsenter.
func (m *mountNamespace) utsPath() string { return "/proc/" + strconv.Itoa(m.holder.Pid()) + "/ns/uts" }

// newMountNamespace makes the node's mount namespace inside the network namespace netns, its
// state under dir, and its UTS namespace named hostname.
func newMountNamespace(ctx context.Context, netns, dir, hostname string) (*mountNamespace, error) {
	for _, d := range []string{"var-lib", "var-log", "sysctl", "cgroup"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	for name, value := range kubeletSysctls {
		if err := os.WriteFile(filepath.Join(dir, "sysctl", filepath.Base(name)), []byte(value+"\n"), 0o444); err != nil {
			return nil, err
		}
	}
	holder, err := startProcess("mount-namespace", filepath.Join(dir, "mount-namespace.log"), Namespaces{Net: netnsPath(netns)}, nil,
		"unshare", "--mount", "--uts", "--propagation=private", "sleep", "infinity")
	if err != nil {
		return nil, err
	}
	m := &mountNamespace{holder: holder, dir: dir}
	if err := m.waitUnshared(ctx); err != nil {
		return nil, errors.Join(err, holder.Kill())
	}
	if err := m.setUp(ctx, netns); err != nil {
		return nil, errors.Join(err, holder.Kill())
	}
	if _, err := (Namespaces{UTS: m.utsPath()}).Run(ctx, cmdTimeout, "hostname", hostname); err != nil {
		return nil, errors.Join(fmt.Errorf("node host name: %w", err), holder.Kill())
	}
	return m, nil
}

// waitUnshared waits until the holder runs in a mount namespace other than ours (unshare has
// made it and exec'd sleep).
func (m *mountNamespace) waitUnshared(ctx context.Context) error {
	ours, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if err := m.holder.alive(); err != nil {
			return err
		}
		if theirs, err := os.Readlink(m.path()); err == nil && theirs != ours {
			if exe, err := os.Readlink("/proc/" + strconv.Itoa(m.holder.Pid()) + "/exe"); err == nil && filepath.Base(exe) == "sleep" {
				return nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.New("the node's mount namespace was not made within 10s")
}

// setUp makes the mounts described above, in order.
func (m *mountNamespace) setUp(ctx context.Context, netns string) error {
	ns := Namespaces{Net: netnsPath(netns), Mount: m.path()}
	cgroup := filepath.Join(m.dir, "cgroup")
	steps := [][]string{
		{"mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"},
		{"mount", "--bind", filepath.Join(m.dir, "var-lib"), "/var/lib"},
		{"mount", "--bind", filepath.Join(m.dir, "var-log"), "/var/log"},
		{"mount", "--rbind", "/sys/fs/cgroup", cgroup},
		{"mount", "-t", "sysfs", "sysfs", "/sys"},
		{"mount", "--rbind", cgroup, "/sys/fs/cgroup"},
		{"umount", "-l", cgroup},
		{"mount", "-t", "bpf", "-o", "mode=0700", "bpffs", "/sys/fs/bpf"},
	}
	for name := range kubeletSysctls {
		steps = append(steps, []string{"mount", "--bind", "-o", "ro", filepath.Join(m.dir, "sysctl", filepath.Base(name)), "/proc/sys/" + name})
	}
	steps = append(steps, []string{"mount", "--make-rshared", "/"})
	for _, argv := range steps {
		if _, err := ns.Run(ctx, cmdTimeout, argv...); err != nil {
			return fmt.Errorf("node mount namespace: %w", err)
		}
	}
	return nil
}

// close ends the holder; the namespace and its mounts go with the last process in it.
func (m *mountNamespace) close() error { return m.holder.Stop(time.Second) }
