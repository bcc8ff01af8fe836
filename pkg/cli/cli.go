// Package cli implements the ip-masq-agent command line: the agent itself and its subcommands.
// Flags keep the upstream ip-masq-agent names and defaults; "--flag=value" and "--flag value"
// both work, and flags may come before or after positional arguments.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// usageError marks a mistake on the command line (exit code 2, as the flag package uses).
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// ExitCode maps an error returned by Run to a process exit code.
func ExitCode(err error) int {
	var ue usageError
	if errors.As(err, &ue) || errors.Is(err, flag.ErrHelp) {
		return 2
	}
	return 1
}

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"explain", "explain [flags] ADDR...   which rule decides each address, and why", runExplain},
		{"render", "render [flags]            print what a backend would apply (--backend: iptables or nftables); nothing is applied", runRender},
		{"dump", "dump [flags]              the installed rules with hit counters, and the NAT table", runDump},
		{"cleanup", "cleanup [flags]           remove everything the agent installed (chains, BPF programs, pins)", runCleanup},
		{"version", "version                   print the version", runVersion},
	}
}

// commandNames lists the subcommands: "explain, render, ...".
func commandNames() string {
	var names []string
	for _, c := range commands() {
		names = append(names, c.name)
	}
	return strings.Join(names, ", ")
}

// Run executes the command line args (without the program name).
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		for _, c := range commands() {
			if c.name == args[0] {
				return c.run(ctx, args[1:], stdout, stderr)
			}
		}
		if args[0] == "help" {
			printUsage(stdout)
			return nil
		}
		return usageError{fmt.Errorf("unknown command %q (see ip-masq-agent help)", args[0])}
	}
	return runAgent(ctx, args, stdout, stderr)
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: ip-masq-agent [flags]          run the agent")
	for _, c := range commands() {
		fmt.Fprintf(w, "       ip-masq-agent %s\n", c.summary)
	}
	fmt.Fprintln(w, "\nrun 'ip-masq-agent COMMAND --help' for the flags of a command")
}

// policyFlags are the flags that decide the policy; the agent and every subcommand take them.
type policyFlags struct {
	configPath              string
	configPattern           string
	enableIPv6              bool
	noMasqAllReservedRanges bool
	randomFully             bool
	toPorts                 string
	masqChain               string
}

func (f *policyFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.configPath, "config", config.DefaultPath, "configuration file (YAML or JSON), or a directory whose --config-pattern files are merged; missing means the defaults")
	fs.StringVar(&f.configPattern, "config-pattern", config.DefaultPattern, "in a --config directory, the files read and merged (a glob on file names)")
	fs.BoolVar(&f.enableIPv6, "enable-ipv6", false, "also manage IPv6 traffic")
	fs.BoolVar(&f.noMasqAllReservedRanges, "nomasq-all-reserved-ranges", false, "add all RFC reserved IPv4 ranges to the default nonMasqueradeCIDRs")
	fs.BoolVar(&f.randomFully, "random-fully", true, "choose masquerade source ports fully at random")
	fs.StringVar(&f.toPorts, "to-ports", "", `masquerade to these source ports only, e.g. "1024-29999,32768-65535" (tcp, udp, sctp; the BPF datapath also uses them for ICMP ids)`)
	fs.StringVar(&f.masqChain, "masq-chain", iptables.DefaultChain, "name of the nat chain for the iptables backend")
}

// options validates the flags that do not depend on the file.
func (f *policyFlags) options() (config.Options, policy.Options, error) {
	if err := iptables.ValidateChain(f.masqChain); err != nil {
		return config.Options{}, policy.Options{}, usageError{err}
	}
	ports, err := policy.ParsePortRanges(f.toPorts)
	if err != nil {
		return config.Options{}, policy.Options{}, usageError{err}
	}
	if err := config.CheckPattern(f.configPattern); err != nil {
		return config.Options{}, policy.Options{}, usageError{err}
	}
	return config.Options{EnableIPv6: f.enableIPv6, NoMasqAllReservedRanges: f.noMasqAllReservedRanges, Pattern: f.configPattern},
		policy.Options{EnableIPv6: f.enableIPv6, RandomFully: f.randomFully, ToPorts: ports}, nil
}

// load reads the configuration (a file or a directory) and compiles the policy.
func (f *policyFlags) load() (*policy.Policy, error) {
	copts, popts, err := f.options()
	if err != nil {
		return nil, err
	}
	cfg, err := config.Load(f.configPath, copts)
	if err != nil {
		return nil, err
	}
	return policy.Compile(cfg, popts), nil
}

// parseInterspersed parses flags that may appear before, between or after positional arguments,
// and returns the positional arguments. "--" ends flag parsing.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usageError{err}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		// fs.Parse consumed a "--" if the argument before rest was one.
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

// parseNoArgs parses the flags of a command that takes no positional arguments.
func parseNoArgs(fs *flag.FlagSet, args []string) error {
	pos, err := parseInterspersed(fs, args)
	if err == nil && len(pos) > 0 {
		err = usageError{fmt.Errorf("%s takes no arguments, got %q", fs.Name(), pos)}
	}
	return err
}

func newFlagSet(name, usage string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: %s\n\nflags:\n", usage)
		fs.PrintDefaults()
	}
	return fs
}

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "ip-masq-agent version", stderr)
	if _, err := parseInterspersed(fs, args); err != nil {
		return err
	}
	fmt.Fprintln(stdout, version.String())
	return nil
}

func runRender(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var pf policyFlags
	fs := newFlagSet("render", "ip-masq-agent render [flags]", stderr)
	pf.register(fs)
	backend := fs.String("backend", iptables.Name, "the backend whose transactions to print: "+renderable())
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	b, ok := backends.Lookup(*backend)
	if !ok || b.Render == nil {
		return usageError{fmt.Errorf("render --backend %q: must be %s", *backend, renderable())}
	}
	p, err := pf.load()
	if err != nil {
		return err
	}
	_, err = io.WriteString(stdout, b.Render(p, backends.Options{Chain: pf.masqChain}))
	return err
}

// renderable names the backends render can print: "iptables or nftables".
func renderable() string {
	var names []string
	for _, b := range backends.All {
		if b.Render != nil {
			names = append(names, b.Name)
		}
	}
	return strings.Join(names, " or ")
}
