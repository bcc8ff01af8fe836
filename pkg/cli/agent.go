package cli

import (
	"context"
	"errors"
	"flag"
	"io"
	"strings"
)

// agentFlags are the flags of the agent itself, beyond the policy flags.
type agentFlags struct {
	policyFlags
	backend        string
	interfaces     string
	metricsAddress string
	bpffs          string
	verbosity      int
}

func (f *agentFlags) register(fs *flag.FlagSet) {
	f.policyFlags.register(fs)
	fs.StringVar(&f.backend, "backend", "auto", "datapath: auto (BPF when the kernel supports it, else iptables), bpf or iptables")
	fs.StringVar(&f.interfaces, "interfaces", "", "comma-separated uplinks to masquerade on (default: the devices of the default routes)")
	fs.StringVar(&f.metricsAddress, "metrics-address", ":9808", "HOST:PORT serving /metrics, /healthz and /readyz; empty disables")
	fs.StringVar(&f.bpffs, "bpffs", "/sys/fs/bpf", "BPF filesystem where maps and links are pinned")
	// Accepted so that upstream manifests keep working: klog verbosity (4 and above log debug).
	fs.IntVar(&f.verbosity, "v", 0, "log verbosity; 4 or more logs debug messages")
	fs.Bool("logtostderr", true, "ignored: logs always go to stderr (accepted for upstream manifests)")
}

func (f *agentFlags) interfaceList() []string {
	var out []string
	for _, s := range strings.Split(f.interfaces, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("ip-masq-agent", "ip-masq-agent [flags]", stderr)
	af.register(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{errors.New("the agent takes no arguments; subcommands: explain, render, version")}
	}
	if _, _, err := af.options(); err != nil {
		return err
	}
	return errors.New("the agent runtime is not part of this build yet")
}
