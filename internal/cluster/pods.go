package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// A pod's network namespace is where its traffic starts and ends. The tests open their
// sockets there from this process (a client pod's connections, a Service backend's
// listeners), as a program in the pod would, so a pod needs no image but the pause one.

// PodNetns returns a namespace file of the pod's network namespace: /proc/PID/ns/net of a
// process of the pod.
func (c *Cluster) PodNetns(uid types.UID) (string, error) {
	pid, err := c.PodProcess(uid, "")
	if err != nil {
		return "", err
	}
	return "/proc/" + strconv.Itoa(pid) + "/ns/net", nil
}

// PodProcess returns the pid of a process in the pod's cgroup (the kubelet's cgroupfs driver
// names it pod<UID>) whose executable's name is exe (any process when exe is empty). Its
// /proc/PID/root is the container's file system.
func (c *Cluster) PodProcess(uid types.UID, exe string) (int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cgroup")
		if err != nil || !containsCgroup(string(b), c.CgroupRoot, "pod"+string(uid)) {
			continue
		}
		if exe != "" {
			if l, err := os.Readlink("/proc/" + e.Name() + "/exe"); err != nil || filepath.Base(l) != exe {
				continue
			}
		}
		return pid, nil
	}
	return 0, fmt.Errorf("no process %q of pod %s", exe, uid)
}

// containsCgroup reports whether a /proc/PID/cgroup file's text names a cgroup below root
// with the path element podDir.
func containsCgroup(procCgroup, root, podDir string) bool {
	for _, line := range strings.Split(procCgroup, "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && strings.HasPrefix(parts[2], root+"/") && slices.Contains(strings.Split(parts[2], "/"), podDir) {
			return true
		}
	}
	return false
}

// DoIn runs fn on an OS thread that has entered the network namespace whose file is path;
// sockets fn makes belong to that namespace for good.
func DoIn(path string, fn func() error) error { return testutil.DoPath(path, fn) }

// Dialer dials from inside the network namespace whose file is path, from the local
// address laddr when it is valid.
func Dialer(path string, laddr net.Addr) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		var conn net.Conn
		err := DoIn(path, func() error {
			d := net.Dialer{LocalAddr: laddr}
			c, err := d.DialContext(ctx, network, address)
			conn = c
			return err
		})
		return conn, err
	}
}

// WaitPodRunning waits until the pod runs with an address and every container ready, and
// returns it.
func (c *Cluster) WaitPodRunning(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := poll(ctx, "pod "+namespace+"/"+name+" running", func() error {
		p, err := c.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("phase %s, %s", p.Status.Phase, describeWaiting(p))
		}
		for _, cs := range p.Status.ContainerStatuses {
			if !cs.Ready {
				return fmt.Errorf("container %s not ready", cs.Name)
			}
		}
		pod = p
		return nil
	}, c.kubelets()...)
	return pod, err
}

// describeWaiting says why a pod's containers wait, for a timeout's error.
func describeWaiting(p *corev1.Pod) string {
	var errs []error
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if w := cs.State.Waiting; w != nil {
			errs = append(errs, fmt.Errorf("%s waiting: %s %s", cs.Name, w.Reason, w.Message))
		}
		if t := cs.State.Terminated; t != nil {
			errs = append(errs, fmt.Errorf("%s terminated: %s %s (exit %d)", cs.Name, t.Reason, t.Message, t.ExitCode))
		}
	}
	for _, cond := range p.Status.Conditions {
		if cond.Status != corev1.ConditionTrue && cond.Message != "" {
			errs = append(errs, fmt.Errorf("%s: %s", cond.Type, cond.Message))
		}
	}
	if len(errs) == 0 {
		return "no container status yet"
	}
	return errors.Join(errs...).Error()
}

// PausePod is a pod that runs only the pause image, on the node, never pulled: a network
// namespace on the pod network with labels, for the tests' sockets.
func PausePod(name string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName:                      NodeName,
			TerminationGracePeriodSeconds: new(int64),
			AutomountServiceAccountToken:  new(bool),
			Containers: []corev1.Container{{
				Name: "pause", Image: PauseRef, ImagePullPolicy: corev1.PullNever,
			}},
		},
	}
}
