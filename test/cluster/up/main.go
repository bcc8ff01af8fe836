// Command up runs a Kubernetes cluster on this machine (package cluster: etcd, the API server,
// controller manager and scheduler, nodes with containerd, the kubelet, kube-proxy and bridge
// CNI, with -dns CoreDNS), entirely in namespaces of its own, until it is told to stop (SIGINT,
// SIGTERM: make cluster-down), then tears it down leaving nothing on the host. make cluster-up
// runs it; it prints how to reach the cluster. With -reap it only removes what dead runs left
// (a killed test binary's or cluster-up's clusters; see cluster.Reap), as make cluster-down does.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(1)
	}
}

func run() error {
	dir := flag.String("dir", "bin/cluster", "the cluster's state (certificates, logs, kubeconfig); emptied first")
	mode := flag.String("proxy-mode", "iptables", "kube-proxy's mode: iptables or nftables")
	image := flag.String("image", "", "an OCI image archive to import into the node (make image writes bin/ip-masq-agent-image.tar)")
	reapOnly := flag.Bool("reap", false, "only remove what dead runs left, then exit")
	nodes := flag.Int("nodes", 1, "the number of nodes")
	dns := flag.Bool("dns", false, "deploy CoreDNS (make coredns builds it)")
	flag.Parse()
	if err := reap(); err != nil || *reapOnly {
		return err
	}
	abs, err := filepath.Abs(*dir)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(abs); err != nil {
		return err
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return err
	}
	var images []string
	if *image != "" {
		images = append(images, *image)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	c, err := cluster.New(ctx, cluster.ClusterOptions{ProxyMode: *mode, Dir: abs, Images: images, Nodes: *nodes, DNS: *dns})
	if err != nil {
		return err
	}
	pidFile := filepath.Join(abs, "pid")
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return errors.Join(err, c.Close())
	}
	fmt.Printf(`cluster up in %.0f s (kube-proxy in %s mode); it lives in network namespaces, so run
kubectl (or helm) inside the control plane's:

  nsenter --net=/run/netns/%s %s/kubectl --kubeconfig=%s get nodes

and commands on a node inside the node's namespaces (its network and mount namespace):

`, time.Since(start).Seconds(), *mode, c.Netns, c.Bin, c.Kubeconfig)
	for _, n := range c.Nodes {
		fmt.Printf("  nsenter --net=/run/netns/%s --mount=/proc/%s/ns/mnt crictl ...   # %s: or ctr, nft, iptables\n", n.Netns, n.MountHolder(), n.Name)
	}
	fmt.Printf("\nLogs are in %s/logs. make cluster-down (or Ctrl-C) tears it down.\n", abs)
	<-ctx.Done()
	fmt.Println("tearing the cluster down")
	err = c.Close()
	_ = os.Remove(pidFile)
	if err != nil {
		return err
	}
	return c.Gone()
}

// reap removes what dead runs left and says so.
func reap() error {
	reaped, err := cluster.Reap(context.Background())
	for _, id := range reaped {
		fmt.Printf("removed the leftovers of dead run %s\n", id)
	}
	return err
}
