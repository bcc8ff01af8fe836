package cluster_test

import (
	"bufio"
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
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
