package cli

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
)

// These cases fail before the agent touches anything; none of them may reach a datapath, since
// unit tests run in the host's namespace.
func TestAgentCommandLineErrors(t *testing.T) {
	tests := []struct {
		args     []string
		wantCode int
		wantErr  string
	}{
		{[]string{"--backend=bpf", "--bpffs=" + os.TempDir()}, 1, "is not a BPF filesystem"},
		{[]string{"--backend=bpf", "--bpffs=/nonexistent/bpffs"}, 1, "--bpffs /nonexistent/bpffs: no such file or directory"},
		{[]string{"--backend=bpf", "--attach-mode=xdp"}, 2, `attach mode "xdp": must be auto, tcx or tc`},
		{[]string{"--backend", "ebpf"}, 2, `backend "ebpf": must be auto, ` + backends.Names()},
		{[]string{"--backend=bpf", "extra"}, 2, "the agent takes no arguments"},
		{[]string{"--masq-chain=POSTROUTING"}, 2, "is a built-in chain"},
		{[]string{"--to-ports=9-1"}, 2, "starts after it ends"},
		{[]string{"--nat-timeouts=udp=0s"}, 2, `"udp=0s": want a positive duration`},
		{[]string{"--nat-timeouts=tcp=1m"}, 2, `"tcp=1m": want KEY=DURATION with KEY one of icmp, other, tcp-closing`},
		{[]string{"--interfaces=eth0,!eth1"}, 2, "name the uplinks, or leave devices out with !name, not both"},
		{[]string{"--nat-sweep-interval=0s"}, 2, "nat-sweep-interval 0s: must be positive"},
		{[]string{"--drift-check-interval=-1s"}, 2, "drift-check-interval -1s: must be positive, or 0"},
		// The label's variable left unexpanded: the pod's env does not define it.
		{[]string{"--template-generation=$(POD_TEMPLATE_GENERATION)"}, 2, `"$(POD_TEMPLATE_GENERATION)": want the pod's template generation`},
		{[]string{"--template-generation=-1"}, 2, `"-1": want the pod's template generation`},
		{[]string{"cleanup", "now"}, 2, "cleanup takes no arguments"},
		{[]string{"cleanup", "--masq-chain=bad name"}, 2, "only letters, digits"},
		{[]string{"cleanup", "--no-such-flag"}, 2, "flag provided but not defined"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := run(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.wantErr)
			}
			if got := ExitCode(err); got != tc.wantCode {
				t.Errorf("exit code %d, want %d", got, tc.wantCode)
			}
		})
	}
}

// The cleanup subcommand takes the agent's flags, so the DaemonSet's arguments can be reused; its
// help lists those it reads (where the datapath is, --v) and names the others as accepted.
func TestCleanupAcceptsAgentFlags(t *testing.T) {
	help := helpOf(t, "cleanup")
	for _, flag := range []string{"-masq-chain", "-bpffs", "-interfaces", "-v", "-force"} {
		if !strings.Contains(help, "\n  "+flag+" ") && !strings.Contains(help, "\n  "+flag+"\n") {
			t.Errorf("cleanup --help does not list %s:\n%s", flag, help)
		}
	}
	_, accepted, _ := strings.Cut(help, "accepted and not read, so that the agent's arguments can be reused: ")
	for _, flag := range []string{"--backend", "--config", "--enable-ipv6", "--metrics-address"} {
		if !strings.Contains(accepted, flag+",") && !strings.HasSuffix(strings.TrimSpace(accepted), flag) {
			t.Errorf("cleanup --help does not name %s as accepted:\n%s", flag, help)
		}
	}
}

// The DaemonSet passes the pod's pod-template-generation label: empty when the pod has none
// (a pod not made by a DaemonSet controller), which is unknown, as 0 is.
func TestParseGeneration(t *testing.T) {
	for s, want := range map[string]int64{"": 0, "0": 0, "7": 7, "12345678901": 12345678901} {
		var got int64 = -1
		if err := parseGeneration(s, &got); err != nil || got != want {
			t.Errorf("parseGeneration(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
}

// Source rules that select pods need the node's name and a client of the API server; without
// either the agent runs, and says which is missing when a configuration selects pods.
func TestPodsNeedNodeAndClient(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // not in a pod, whatever runs the tests
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://192.0.2.1:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		node, kubeconfig string
		wantWhy          string // empty: a watcher
	}{
		{"", kubeconfig, "no --node-name, and NODE_NAME is not set"},
		{"node-a", "", "no --kubeconfig, and not in a pod with a service account"},
		{"node-a", missing, "kubeconfig " + missing},
		{"node-a", kubeconfig, ""},
	} {
		f := &sourceFlags{kubeconfig: tc.kubeconfig}
		w, why := f.pods(tc.node, log)
		switch {
		case tc.wantWhy == "" && (w == nil || why != ""):
			t.Errorf("node %q, kubeconfig %q: no watcher: %s", tc.node, tc.kubeconfig, why)
		case tc.wantWhy != "" && (w != nil || !strings.HasPrefix(why, "run the agent with --config-source=configmap or crd") ||
			!strings.Contains(why, tc.wantWhy)):
			t.Errorf("node %q, kubeconfig %q: watcher %v, %q; want none because %q", tc.node, tc.kubeconfig, w != nil, why, tc.wantWhy)
		}
	}
}
