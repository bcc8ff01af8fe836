// Package e2e is the end-to-end harness: throwaway network namespaces (a pod, the node, an
// external host), the real agent binary running inside the node namespace, and probes that
// report which source address the external host sees. The scenario table in scenarios.go is
// backend-independent; a Backend value says how to select and verify one datapath.
//
// Everything here acts only inside namespaces the harness created, and sends traffic only to
// addresses that live inside them. Tests import this package; production code never does.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// cmdTimeout bounds every command the harness runs (times TimeoutScaleEnv).
var cmdTimeout = Scaled(20 * time.Second)

// run runs a command with the payload on stdin and returns its output; the error carries stderr.
func run(ctx context.Context, stdin string, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, cmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = time.Second
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// NSExec runs a command inside a namespace (ip netns exec) and returns its standard output.
func NSExec(ctx context.Context, ns string, stdin string, name string, args ...string) ([]byte, error) {
	return run(ctx, stdin, "ip", append([]string{"netns", "exec", ns, name}, args...)...)
}

// WriteSysctl sets a per-namespace sysctl: /proc/sys/net resolves to the namespace of the thread
// that opens it.
func WriteSysctl(ns, key, value string) error {
	return testutil.Do(ns, func() error {
		path := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
		if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
			return fmt.Errorf("sysctl %s in %s: %w", key, ns, err)
		}
		return nil
	})
}

// TCPExt reads one TcpExt counter of namespace ns (/proc/net/netstat: a header line of names,
// then a line of values), such as TCPSynRetrans: the SYNs its sockets sent again.
func TCPExt(ctx context.Context, tb testing.TB, ns, name string) int64 {
	tb.Helper()
	out, err := NSExec(ctx, ns, "", "cat", "/proc/net/netstat")
	if err != nil {
		tb.Fatalf("read netstat of %s: %v", ns, err)
	}
	lines := strings.Split(string(out), "\n")
	for i := 0; i+1 < len(lines); i++ {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "TcpExt:" || len(values) != len(names) {
			continue
		}
		if j := slices.Index(names, name); j > 0 {
			v, err := strconv.ParseInt(values[j], 10, 64)
			if err != nil {
				tb.Fatalf("netstat of %s: %s: %v", ns, name, err)
			}
			return v
		}
	}
	tb.Fatalf("netstat of %s: no TcpExt %s", ns, name)
	return 0
}
