package cluster_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestNode brings a whole cluster up, runs a pod on the node, reaches a listener in the pod's
// network namespace from the outside namespace (the pod network is routed, nothing
// translated), tears the cluster down and checks that nothing of it is left on the host.
func TestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cluster.Require(t)
	start := time.Now()
	c, err := cluster.New(ctx, cluster.ClusterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if t.Failed() {
			c.LogTails(t)
		}
		if !closed {
			_ = c.Close()
		}
	}()
	t.Logf("cluster up in %v", time.Since(start).Round(time.Millisecond))

	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, cluster.PausePod("p", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := c.WaitPodRunning(ctx, "default", "p")
	if err != nil {
		t.Fatal(err)
	}
	podIP := netip.MustParseAddr(pod.Status.PodIP)
	if !cluster.DefaultPodCIDR.Contains(podIP) {
		t.Fatalf("pod address %s outside the pod range %s", podIP, cluster.DefaultPodCIDR)
	}
	t.Logf("pod running at %s after %v", podIP, time.Since(start).Round(time.Millisecond))
	path, err := c.PodNetns(pod.UID)
	if err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	if err := cluster.DoIn(path, func() (err error) { ln, err = net.Listen("tcp", ":8080"); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = conn.Write([]byte(conn.RemoteAddr().String() + "\n"))
			conn.Close()
		}
	}()
	conn, err := cluster.Dialer("/run/netns/"+c.Outside, nil)(ctx, "tcp", net.JoinHostPort(podIP.String(), "8080"))
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	conn.Close()
	if err != nil {
		t.Fatal(err)
	}
	if host, _, _ := net.SplitHostPort(strings.TrimSpace(line)); host != cluster.OutsideAddress.String() {
		t.Fatalf("the pod saw the outside client as %q, want %s", line, cluster.OutsideAddress)
	}

	closed = true
	start = time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("cluster down in %v", time.Since(start).Round(time.Millisecond))
	if err := c.Gone(); err != nil {
		t.Fatal(err)
	}
}

// TestNodes brings a two-node cluster with CoreDNS up. A pod on node-1 reaches a pod on
// node-2, which sees the client pod's own address (the nodes route each other's pod ranges,
// nothing translated); a hostPort of the pod on node-2 reaches it from the outside namespace
// and from the pod on node-1; the pod on node-1 reaches an extra outside address (a stand-in
// for an Internet host); pods on both nodes resolve Services' names through CoreDNS at
// DNSAddress; after Close nothing of either node is left on the host.
func TestNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cluster.RequireDNS(t)
	start := time.Now()
	internet := netip.MustParseAddr("8.8.8.8")
	c, err := cluster.New(ctx, cluster.ClusterOptions{Nodes: 2, DNS: true, OutsideAddrs: []netip.Prefix{netip.PrefixFrom(internet, 32)}})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if t.Failed() {
			c.LogTails(t)
		}
		if !closed {
			_ = c.Close()
		}
	}()
	t.Logf("cluster of %d nodes with DNS up in %v", len(c.Nodes), time.Since(start).Round(time.Millisecond))
	if len(c.Nodes) != 2 || c.Nodes[0].Name != cluster.NodeName || c.Nodes[0].Address != cluster.NodeAddress ||
		c.Nodes[0].PodCIDR != cluster.DefaultPodCIDR || c.Node != c.Nodes[0].Netns {
		t.Fatalf("nodes %+v, %+v: want node 1 to be the single node's", c.Nodes[0], c.Nodes[1:])
	}

	const hostPort = 30555
	var pods []*corev1.Pod
	for i, n := range c.Nodes {
		p := cluster.PausePod(fmt.Sprintf("p%d", i+1), nil)
		p.Spec.NodeName = n.Name
		p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 8080, HostPort: hostPort, Protocol: corev1.ProtocolTCP}}
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	paths := map[string]string{} // pod name: its network namespace
	for i, n := range c.Nodes {
		pod, err := c.WaitPodRunning(ctx, "default", fmt.Sprintf("p%d", i+1))
		if err != nil {
			t.Fatal(err)
		}
		if ip := netip.MustParseAddr(pod.Status.PodIP); pod.Spec.NodeName != n.Name || !n.PodCIDR.Contains(ip) {
			t.Fatalf("pod %s runs on %s at %s, want %s in %s", pod.Name, pod.Spec.NodeName, ip, n.Name, n.PodCIDR)
		}
		if paths[pod.Name], err = c.PodNetns(pod.UID); err != nil {
			t.Fatal(err)
		}
		pods = append(pods, pod)
	}
	t.Logf("pods running at %s and %s after %v", pods[0].Status.PodIP, pods[1].Status.PodIP, time.Since(start).Round(time.Millisecond))
	echo(t, paths["p2"], ":8080")
	echo(t, "/run/netns/"+c.Outside, net.JoinHostPort(internet.String(), "53"))
	for _, tc := range []struct {
		name, from, to, want string
	}{
		{"pod to pod across nodes", paths["p1"], net.JoinHostPort(pods[1].Status.PodIP, "8080"), pods[0].Status.PodIP},
		{"outside to hostPort", "/run/netns/" + c.Outside, net.JoinHostPort(c.Nodes[1].Address.String(), strconv.Itoa(hostPort)), cluster.OutsideAddress.String()},
		{"pod to the other node's hostPort", paths["p1"], net.JoinHostPort(c.Nodes[1].Address.String(), strconv.Itoa(hostPort)), pods[0].Status.PodIP},
		{"pod to an outside address", paths["p1"], net.JoinHostPort(internet.String(), "53"), pods[0].Status.PodIP},
	} {
		if got, err := askEcho(ctx, tc.from, tc.to); err != nil || got != tc.want {
			t.Errorf("%s (%s): the server saw %q (%v), want %s", tc.name, tc.to, got, err, tc.want)
		}
	}

	// A hostNetwork pod is in its node's UTS namespace, named after the node, as on a real
	// node (the e2e tests' hostNetwork servers answer with their node's name).
	for _, n := range c.Nodes {
		if out, err := n.Namespaces().Run(ctx, 10*time.Second, "hostname"); err != nil || strings.TrimSpace(out) != n.Name {
			t.Errorf("node %s's host name is %q (%v)", n.Name, strings.TrimSpace(out), err)
		}
	}
	host := cluster.PausePod("host", nil)
	host.Spec.NodeName, host.Spec.HostNetwork = c.Nodes[1].Name, true
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, host, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if pod, err := c.WaitPodRunning(ctx, "default", "host"); err != nil {
		t.Fatal(err)
	} else if pid, err := c.PodProcess(pod.UID, "pause"); err != nil {
		t.Fatal(err)
	} else if out, err := (cluster.Namespaces{UTS: fmt.Sprintf("/proc/%d/ns/uts", pid)}).Run(ctx, 10*time.Second, "hostname"); err != nil ||
		strings.TrimSpace(out) != c.Nodes[1].Name {
		t.Errorf("a hostNetwork pod on %s has the host name %q (%v)", c.Nodes[1].Name, strings.TrimSpace(out), err)
	}

	for _, pod := range pods {
		r := cluster.DNSResolver(paths[pod.Name])
		for name, want := range map[string]string{
			"kubernetes.default.svc.cluster.local.":   cluster.DefaultServiceCIDR.Addr().Next().String(),
			"kube-dns.kube-system.svc.cluster.local.": cluster.DNSAddress,
		} {
			if addrs, err := r.LookupHost(ctx, name); err != nil || len(addrs) != 1 || addrs[0] != want {
				t.Errorf("pod %s resolves %s as %v (%v), want %s", pod.Name, name, addrs, err, want)
			}
		}
	}

	closed = true
	start = time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("cluster down in %v", time.Since(start).Round(time.Millisecond))
	if err := c.Gone(); err != nil {
		t.Fatal(err)
	}
}

// echo serves, in the network namespace whose file is path, a TCP listener on addr that
// answers each connection with the client's address, until the test ends.
func echo(t *testing.T, path, addr string) {
	t.Helper()
	var ln net.Listener
	if err := cluster.DoIn(path, func() (err error) { ln, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = conn.Write([]byte(conn.RemoteAddr().String() + "\n"))
			conn.Close()
		}
	}()
}

// askEcho connects from the network namespace whose file is path to an echo server at addr
// and returns the client address the server saw.
func askEcho(ctx context.Context, path, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := cluster.Dialer(path, nil)(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", err
	}
	host, _, err := net.SplitHostPort(strings.TrimSpace(line))
	return host, err
}
