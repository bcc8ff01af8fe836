package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A pod's processes are not the test's children: containerd's shims reparent themselves and
// the containers live in cgroups below the kubelet's cgroup root, so ending the components
// ends none of them. Teardown finds them by what they share with the node (its network or
// mount namespace, or a cgroup below its root) and kills them by PID, then removes the cgroups.

// nodeProcesses are the processes, other than skip, in the node's network or mount namespace
// or in a cgroup below its cgroup root.
func (c *Cluster) nodeProcesses(skip int) ([]int, error) {
	netLink, err := nsLink(netnsPath(c.Node), "net")
	if err != nil {
		return nil, err
	}
	mntLink := ""
	if c.mnt != nil {
		mntLink, _ = os.Readlink(c.mnt.path())
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == skip || pid == os.Getpid() {
			continue
		}
		dir := "/proc/" + e.Name()
		if l, _ := os.Readlink(dir + "/ns/net"); l == netLink {
			pids = append(pids, pid)
			continue
		}
		if l, _ := os.Readlink(dir + "/ns/mnt"); mntLink != "" && l == mntLink {
			pids = append(pids, pid)
			continue
		}
		if inCgroup(dir+"/cgroup", c.CgroupRoot) {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// nsLink is what /proc/PID/ns/KIND reads for the namespace whose file is path ("net:[INODE]").
func nsLink(path, kind string) (string, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s:[%d]", kind, st.Ino), nil
}

// inCgroup reports whether a /proc/PID/cgroup file names a cgroup at or below root in any
// hierarchy.
func inCgroup(file, root string) bool {
	b, err := os.ReadFile(file)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[2] == root || strings.HasPrefix(parts[2], root+"/")) {
			return true
		}
	}
	return false
}

// killLeftovers kills the node's processes (but the mount namespace's holder) until none is
// left, then removes the cgroups below the cgroup root.
func (c *Cluster) killLeftovers() error {
	skip := 0
	if c.mnt != nil {
		skip = c.mnt.holder.Pid()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		pids, err := c.nodeProcesses(skip)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes of the node survive SIGKILL: %v", pids)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return removeCgroups(c.CgroupRoot)
}

// cgroupDirs are the directories of root in every cgroup hierarchy mounted under
// /sys/fs/cgroup (v1 controllers, the named systemd one, the unified v2 one).
func cgroupDirs(root string) []string {
	var dirs []string
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	for _, e := range entries {
		if e.Type()&fs.ModeSymlink != 0 || !e.IsDir() {
			continue
		}
		d := filepath.Join("/sys/fs/cgroup", e.Name(), root)
		if _, err := os.Stat(d); err == nil {
			dirs = append(dirs, d)
		}
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", root)); err == nil {
		dirs = append(dirs, filepath.Join("/sys/fs/cgroup", root)) // a pure v2 host
	}
	return dirs
}

// removeCgroups removes root's cgroups, deepest first, in every hierarchy; a cgroup that is
// still busy (its last process exiting) is tried again for a while.
func removeCgroups(root string) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		var left []string
		for _, top := range cgroupDirs(root) {
			var dirs []string
			_ = filepath.WalkDir(top, func(path string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, path)
				}
				return nil
			})
			slices.Reverse(dirs)
			for _, d := range dirs {
				if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
					left = append(left, d)
				}
			}
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroups left: %v", left)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// hostPaths are the places on a host where a kubelet and containerd keep their state; the
// node's are its mount namespace's, so none of them may appear on the host.
var hostPaths = []string{"/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/var/log/pods",
	"/var/log/containers", "/var/lib/cni", "/run/runc", "/opt/containerd", "/var/run/kubernetes"}

// trace is what identifies a cluster on the host, recorded while it runs, so that Gone can
// look for it once the namespaces' files are gone.
type trace struct {
	netns      []string // network namespace names
	links      []string // "net:[INODE]", "mnt:[INODE]" of its namespaces
	cgroupRoot string
	dir        string
	hostPaths  map[string]bool // which of hostPaths the host had before
}

func existing(paths []string) map[string]bool {
	m := map[string]bool{}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			m[p] = true
		}
	}
	return m
}

// record notes the running cluster's trace.
func (c *Cluster) record() error {
	c.trace.netns = []string{c.Netns, c.Node, c.Outside}
	for _, ns := range c.trace.netns {
		l, err := nsLink(netnsPath(ns), "net")
		if err != nil {
			return err
		}
		c.trace.links = append(c.trace.links, l)
	}
	l, err := os.Readlink(c.mnt.path())
	if err != nil {
		return err
	}
	c.trace.links = append(c.trace.links, l)
	c.trace.cgroupRoot, c.trace.dir = c.CgroupRoot, c.Dir
	return nil
}

// Gone checks, after Close, that nothing of the cluster is left on the host: no network
// namespace, no process in one of its namespaces or cgroups, no cgroup, no mount, no state
// directory, no host path of a kubelet or containerd that the host did not have before.
func (c *Cluster) Gone() error {
	var errs []error
	for _, ns := range c.trace.netns {
		if _, err := os.Lstat(netnsPath(ns)); err == nil {
			errs = append(errs, fmt.Errorf("network namespace %s is left", ns))
		}
	}
	// A process killed a moment ago may still be on its way out.
	var left []error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if left = c.leftProcesses(); len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	errs = append(errs, left...)
	if dirs := cgroupDirs(c.trace.cgroupRoot); len(dirs) > 0 {
		errs = append(errs, fmt.Errorf("cgroups are left: %v", dirs))
	}
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(mi), c.trace.dir) {
		errs = append(errs, fmt.Errorf("a mount of %s is left", c.trace.dir))
	}
	if _, err := os.Lstat(c.trace.dir); err == nil && c.ownDir {
		errs = append(errs, fmt.Errorf("the state directory %s is left", c.trace.dir))
	}
	for _, p := range hostPaths {
		if _, err := os.Lstat(p); err == nil && !c.trace.hostPaths[p] {
			errs = append(errs, fmt.Errorf("host path %s was made", p))
		}
	}
	return errors.Join(errs...)
}

// makeCgroups makes root's cgroup in every hierarchy, as the kubelet wants its cgroup root to
// exist; cpuset's gets its parent's CPUs and memory nodes (a v1 cpuset starts with none).
func makeCgroups(root string) error {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type()&fs.ModeSymlink != 0 || !e.IsDir() {
			continue
		}
		top := filepath.Join("/sys/fs/cgroup", e.Name())
		if err := os.Mkdir(filepath.Join(top, root), 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(top, f)); err == nil {
				if err := os.WriteFile(filepath.Join(top, root, f), b, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", filepath.Join(top, root, f), err)
				}
			}
		}
	}
	return nil
}

// comm is a process's command line, for errors.
func comm(procDir string) string {
	b, _ := os.ReadFile(procDir + "/cmdline")
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}

// leftProcesses are the processes in one of the cluster's namespaces or cgroups, but this one:
// its threads enter the namespaces for the tests' sockets, and one the Go runtime cannot end
// (the main thread) stays where it was until the test binary exits.
func (c *Cluster) leftProcesses() []error {
	var errs []error
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return []error{err}
	}
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err != nil || pid == os.Getpid() {
			continue
		}
		dir := "/proc/" + e.Name()
		for _, kind := range []string{"net", "mnt"} {
			if l, _ := os.Readlink(dir + "/ns/" + kind); slices.Contains(c.trace.links, l) {
				errs = append(errs, fmt.Errorf("process %s (%s) is left in the cluster's namespace %s", e.Name(), comm(dir), l))
			}
		}
		if inCgroup(dir+"/cgroup", c.trace.cgroupRoot) {
			errs = append(errs, fmt.Errorf("process %s (%s) is left in cgroup %s", e.Name(), comm(dir), c.trace.cgroupRoot))
		}
	}
	return errs
}
