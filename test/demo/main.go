// Command demo shows the agent at work in a throwaway sandbox of network namespaces: two pods, a
// node running the agent with the built-in default configuration, and an external host that
// owns a handful of destinations and reports the source address each connection arrives from.
// It prints, side by side, what the external host saw and what `explain` says, then the live
// counters (`dump`), and removes everything it created. The host's own namespace, interfaces,
// routes and firewall are never touched; traffic goes only to addresses inside the sandbox.
//
//	go run ./test/demo -bin bin/ip-masq-agent [-backend bpf|iptables]
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

const (
	echoPort = 7777
	// sharedPort is the source port both pods use toward the same destination, to show that the
	// masquerade gives them distinct ports on the node's address.
	sharedPort = 40000
)

var (
	nodeUplink = netip.MustParseAddr("203.0.113.10")
	extUplink  = netip.MustParseAddr("203.0.113.1")
	pods       = []pod{
		{"pod-a", netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.1")},
		{"pod-b", netip.MustParseAddr("10.244.2.2"), netip.MustParseAddr("10.244.2.1")},
	}
	// The external host owns these; the comments say what the default configuration does.
	destinations = []netip.Addr{
		netip.MustParseAddr("8.8.8.8"),         // the internet: masqueraded
		netip.MustParseAddr("1.1.1.1"),         // the internet: masqueraded
		netip.MustParseAddr("10.1.2.3"),        // RFC 1918: keeps the pod address
		netip.MustParseAddr("172.16.5.5"),      // RFC 1918
		netip.MustParseAddr("192.168.1.1"),     // RFC 1918
		netip.MustParseAddr("169.254.169.254"), // link-local: keeps the pod address
		netip.MustParseAddr("100.64.0.1"),      // shared address space: masqueraded by default
	}
)

type pod struct {
	name    string
	addr    netip.Addr
	gateway netip.Addr
}

func main() {
	bin := flag.String("bin", "bin/ip-masq-agent", "the agent binary")
	backend := flag.String("backend", "bpf", "datapath backend: bpf or iptables")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *bin, *backend); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// sandbox is everything the demo created, so that it can all be removed.
type sandbox struct {
	prefix           string
	pods             map[string]string // pod name -> namespace
	node, ext        string
	dir, bpffs       string
	bpffsMounted     bool
	namespaces       []string
	stopEcho         func()
	agent            *e2e.Agent
	bin, backend     string
	agentArgs        []string
	configPath       string
	cleanupRequested bool
}

func run(ctx context.Context, bin, backend string) (err error) {
	if os.Geteuid() != 0 {
		return errors.New("the demo creates network namespaces: run it as root")
	}
	if bin, err = filepath.Abs(bin); err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("agent binary: %w (run make build)", err)
	}
	var b [3]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	sb := &sandbox{prefix: "ipmasq-demo-" + hex.EncodeToString(b[:]), pods: map[string]string{}, bin: bin, backend: backend}
	defer func() {
		if cerr := sb.teardown(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if err := sb.build(ctx); err != nil {
		return err
	}
	fmt.Printf("sandbox %s: %s, %s -> node (uplink %s) -> external host %s\n",
		sb.prefix, describePod(pods[0]), describePod(pods[1]), nodeUplink, extUplink)
	fmt.Printf("the external host owns %s\n\n", joinAddrs(destinations))

	took, err := sb.startAgent(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("agent: %s %s\n", filepath.Base(bin), strings.Join(e2e.AgentArgs(sb.agentArgs...), " "))
	fmt.Printf("       no config file: the built-in defaults; ready after %v\n\n", took.Round(time.Millisecond))

	if err := sb.showDecisions(ctx); err != nil {
		return err
	}
	if err := sb.showSharedPort(ctx); err != nil {
		return err
	}
	fmt.Println("== counters: ip-masq-agent dump (a second process beside the agent)")
	out, err := e2e.NSExec(ctx, sb.node, "", sb.bin, sb.policyAndDatapathFlags("dump")...)
	if err != nil {
		return fmt.Errorf("dump: %w", err)
	}
	fmt.Println(indent(string(out)))
	return nil
}

func describePod(p pod) string { return fmt.Sprintf("%s %s", p.name, p.addr) }

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}

func (sb *sandbox) newNetns(ctx context.Context, role string) (string, error) {
	name := sb.prefix + "-" + role
	if err := testutil.CreateNetns(ctx, name); err != nil {
		return "", err
	}
	sb.namespaces = append(sb.namespaces, name)
	return name, nil
}

func (sb *sandbox) build(ctx context.Context) error {
	var err error
	if sb.node, err = sb.newNetns(ctx, "node"); err != nil {
		return err
	}
	if sb.ext, err = sb.newNetns(ctx, "ext"); err != nil {
		return err
	}
	for _, p := range pods {
		if sb.pods[p.name], err = sb.newNetns(ctx, p.name); err != nil {
			return err
		}
	}
	// Veths are created from the node's side, so nothing ever appears in the host namespace.
	var node strings.Builder
	fmt.Fprintf(&node, "link set lo up\nlink add uplink type veth peer name eth0 netns %s\n", sb.ext)
	fmt.Fprintf(&node, "addr add %s/24 dev uplink\nlink set uplink up\nroute add default via %s dev uplink\n", nodeUplink, extUplink)
	for _, p := range pods {
		fmt.Fprintf(&node, "link add %s type veth peer name eth0 netns %s\n", p.name, sb.pods[p.name])
		fmt.Fprintf(&node, "addr add %s/24 dev %s\nlink set %s up\n", p.gateway, p.name, p.name)
	}
	if err := testutil.IPBatch(ctx, sb.node, node.String()); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	if err := e2e.WriteSysctl(sb.node, "net.ipv4.ip_forward", "1"); err != nil {
		return err
	}
	for _, p := range pods {
		batch := fmt.Sprintf("link set lo up\naddr add %s/24 dev eth0\nlink set eth0 up\nroute add default via %s dev eth0\n", p.addr, p.gateway)
		if err := testutil.IPBatch(ctx, sb.pods[p.name], batch); err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
	}
	// The external host routes the pod network back to the node, so that a connection that
	// kept its pod address is answered and its source can be shown.
	var ext strings.Builder
	fmt.Fprintf(&ext, "link set lo up\naddr add %s/24 dev eth0\nlink set eth0 up\nroute add 10.244.0.0/16 via %s dev eth0\n", extUplink, nodeUplink)
	for _, d := range destinations {
		fmt.Fprintf(&ext, "addr add %s/32 dev lo\n", d)
	}
	if err := testutil.IPBatch(ctx, sb.ext, ext.String()); err != nil {
		return fmt.Errorf("external host: %w", err)
	}
	stop, err := e2e.StartEcho(sb.ext, destinations, echoPort)
	if err != nil {
		return fmt.Errorf("echo servers: %w", err)
	}
	sb.stopEcho = stop

	if sb.dir, err = os.MkdirTemp("", sb.prefix+"-"); err != nil {
		return err
	}
	sb.configPath = filepath.Join(sb.dir, "config", "ip-masq-agent") // never written: the defaults
	if err := os.MkdirAll(filepath.Dir(sb.configPath), 0o755); err != nil {
		return err
	}
	// A private BPF filesystem for the pins: the host's /sys/fs/bpf is left alone.
	sb.bpffs = filepath.Join(sb.dir, "bpffs")
	if err := os.MkdirAll(sb.bpffs, 0o700); err != nil {
		return err
	}
	if err := syscall.Mount("bpf", sb.bpffs, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", sb.bpffs, err)
	}
	sb.bpffsMounted = true
	return nil
}

// policyAndDatapathFlags are the flags every command of the demo shares with the agent.
func (sb *sandbox) policyAndDatapathFlags(cmd string) []string {
	args := []string{"--config=" + sb.configPath, "--bpffs=" + sb.bpffs}
	if cmd != "explain" {
		args = append(args, "--backend="+sb.backend)
	}
	if cmd != "" {
		args = append([]string{cmd}, args...)
	}
	return args
}

func (sb *sandbox) startAgent(ctx context.Context) (time.Duration, error) {
	sb.agentArgs = append(sb.policyAndDatapathFlags(""), "--interfaces=uplink")
	start := time.Now()
	a, err := e2e.SpawnAgent(ctx, sb.node, sb.bin, sb.agentArgs...)
	if err != nil {
		return 0, fmt.Errorf("start agent: %w", err)
	}
	sb.agent = a
	wctx, cancel := context.WithTimeout(ctx, e2e.Scaled(20*time.Second))
	defer cancel()
	if err := a.WaitReady(wctx); err != nil {
		return 0, fmt.Errorf("the agent is not ready (%v); its log:\n%s", err, a.Logs())
	}
	return time.Since(start), nil
}

// probe connects from a pod to dst's echo server and returns the source the external host saw.
func (sb *sandbox) probe(ctx context.Context, p pod, proto string, dst netip.Addr, srcPort int) (string, error) {
	var reply string
	err := testutil.Do(sb.pods[p.name], func() error {
		ctx, cancel := context.WithTimeout(ctx, e2e.Scaled(3*time.Second))
		defer cancel()
		d := net.Dialer{}
		if srcPort != 0 {
			d.LocalAddr = &net.TCPAddr{IP: p.addr.AsSlice(), Port: srcPort}
			// Let two pods' sockets and a quick rerun reuse the port at once.
			d.Control = func(_, _ string, c syscall.RawConn) error {
				var serr error
				err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1) })
				return errors.Join(err, serr)
			}
		}
		conn, err := d.DialContext(ctx, proto, netip.AddrPortFrom(dst, echoPort).String())
		if err != nil {
			return err
		}
		defer conn.Close()
		deadline, _ := ctx.Deadline()
		_ = conn.SetDeadline(deadline)
		if proto == "udp" {
			if _, err := conn.Write([]byte("hello\n")); err != nil {
				return err
			}
		}
		line, err := bufio.NewReader(conn).ReadString('\n')
		reply = strings.TrimPrefix(strings.TrimSpace(line), "from ")
		return err
	})
	return reply, err
}

func (sb *sandbox) classify(seen string) string {
	ap, err := netip.ParseAddrPort(seen)
	if err != nil {
		return ""
	}
	switch a := ap.Addr().Unmap(); {
	case a == nodeUplink:
		return "node address"
	case a.Is4() && netip.MustParsePrefix("10.244.0.0/16").Contains(a):
		return "pod address"
	}
	return ""
}

func (sb *sandbox) showDecisions(ctx context.Context) error {
	// In the node's namespace, beside its bpffs: explain also names the datapath installed there.
	args := append([]string{"netns", "exec", sb.node, sb.bin}, sb.policyAndDatapathFlags("explain")...)
	out, err := exec.CommandContext(ctx, "ip", append(args, joinFields(destinations)...)...).Output()
	if err != nil {
		return fmt.Errorf("explain: %w", err)
	}
	table, installed, _ := strings.Cut(strings.TrimSpace(string(out)), "\n\n")
	explained := map[string]string{}
	for _, line := range strings.Split(table, "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 1 {
			explained[f[0]] = strings.Join(f[1:], " ")
		}
	}
	fmt.Println("== what the external host saw, beside what `ip-masq-agent explain` says (from pod-a)")
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DESTINATION\tTCP SOURCE SEEN\tUDP SOURCE SEEN\tEXPLAIN")
	for _, d := range destinations {
		row := []string{d.String()}
		for _, proto := range []string{"tcp", "udp"} {
			seen, err := sb.probe(ctx, pods[0], proto, d, 0)
			if err != nil {
				row = append(row, "no answer: "+err.Error())
				continue
			}
			row = append(row, fmt.Sprintf("%s (%s)", seen, sb.classify(seen)))
		}
		row = append(row, explained[d.String()])
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Println()
	if installed != "" {
		fmt.Println(installed)
		fmt.Println()
	}
	return nil
}

func (sb *sandbox) showSharedPort(ctx context.Context) error {
	dst := destinations[0]
	fmt.Printf("== both pods connect from source port %d to %s:%d\n", sharedPort, dst, echoPort)
	for _, p := range pods {
		seen, err := sb.probe(ctx, p, "tcp", dst, sharedPort)
		if err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
		fmt.Printf("   %s %s:%d -> the external host saw %s (%s)\n", p.name, p.addr, sharedPort, seen, sb.classify(seen))
	}
	fmt.Println()
	return nil
}

func joinFields(as []netip.Addr) []string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return s
}

// teardown stops the agent, removes what it installed, and deletes every namespace, the pins
// and the temporary directory. It runs whatever happened before.
func (sb *sandbox) teardown() error {
	ctx, cancel := context.WithTimeout(context.Background(), e2e.Scaled(30*time.Second))
	defer cancel()
	var errs []error
	if sb.agent != nil {
		stopCtx, stopCancel := context.WithTimeout(ctx, 5*time.Second)
		_ = sb.agent.Stop(stopCtx) // SIGTERM leaves the datapath in place; cleanup removes it
		stopCancel()
		if err := sb.agent.KillGroup(5 * time.Second); err != nil {
			errs = append(errs, fmt.Errorf("agent: %w", err))
		}
		if _, err := e2e.NSExec(ctx, sb.node, "", sb.bin, sb.policyAndDatapathFlags("cleanup")...); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
	}
	if sb.stopEcho != nil {
		sb.stopEcho()
	}
	for _, ns := range sb.namespaces {
		if err := testutil.DeleteNetns(ctx, ns); err != nil {
			errs = append(errs, err)
		}
	}
	if sb.bpffsMounted {
		if err := syscall.Unmount(sb.bpffs, 0); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", sb.bpffs, err))
		}
	}
	if sb.dir != "" {
		if err := os.RemoveAll(sb.dir); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		fmt.Printf("sandbox %s removed: namespaces, pins and the agent's state are gone\n", sb.prefix)
	}
	return errors.Join(errs...)
}

func indent(s string) string {
	return "   " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   ")
}
