package docs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/cli"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// runnable are the commands whose examples the pages show with their output, which need
// nothing but the configuration: each `$ ip-masq-agent explain ...` or `render ...` line is
// run, and what it prints must be the lines below it.
var runnable = []string{"explain", "render"}

// invalid marks a yaml block that shows a configuration that must not parse.
const invalid = "invalid"

// An example names its configuration in the comment right above its code block:
//
//	<!-- example: defaults -->                           the built-in defaults (no file)
//	<!-- example: above -->                              the page's nearest yaml block above
//	<!-- example: deploy/examples/configmap-x.yaml -->   a file of the repository
//	<!-- example: a=deploy/base/configmap.yaml b=above --> a config directory of files a and b
//
// A yaml block or file that is a ConfigMap stands for its config key, as the kubelet mounts it.
// A command that fails shows what the binary prints then, "ip-masq-agent: " and the error,
// with the --config path the page names. A yaml block that shows a bad configuration says so:
// <!-- example: invalid --> (TestConfigurationsParse then expects it not to parse).
func TestExamplesPrintWhatThePagesShow(t *testing.T) {
	for _, page := range pages(t) {
		text := read(t, page)
		blocks, err := markdown.Blocks(text)
		if err != nil {
			t.Fatalf("%s: %v", page, err)
		}
		for i, b := range blocks {
			cmds := commands(b.Body)
			switch {
			case b.Lang == "yaml" && b.Example == invalid:
				continue
			case len(cmds) == 0 && b.Example != "":
				t.Errorf("%s:%d: an example comment on a block that runs no %s", page, b.Line, strings.Join(runnable, " or "))
				continue
			case len(cmds) == 0:
				continue
			case b.Example == "":
				t.Errorf("%s:%d: runs ip-masq-agent %s, but no <!-- example: ... --> above it names its configuration", page, b.Line, cmds[0].args[0])
				continue
			}
			cfg, err := configOf(t, page, blocks[:i], b.Example)
			if err != nil {
				t.Errorf("%s:%d: %v", page, b.Line, err)
				continue
			}
			for _, c := range cmds {
				got, err := run(c.args, cfg)
				if err != nil {
					t.Errorf("%s:%d: ip-masq-agent %s: %v", page, b.Line+c.line, strings.Join(c.args, " "), err)
					continue
				}
				if got != c.want {
					t.Errorf("%s:%d: ip-masq-agent %s prints\n%s\nthe page shows\n%s", page, b.Line+c.line, strings.Join(c.args, " "), got, c.want)
				}
			}
		}
	}
}

// command is one "$ ip-masq-agent ..." line of a code block and the output shown below it.
type command struct {
	line int // in the block, counting from 1
	args []string
	want string
}

func commands(body string) []command {
	var out []command
	var cur *command
	var want []string
	flush := func() {
		if cur != nil {
			cur.want = strings.Join(want, "\n")
			out = append(out, *cur)
			cur = nil
		}
	}
	for i, l := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(l, "$ "); ok {
			flush()
			f := strings.Fields(rest)
			if len(f) > 1 && f[0] == "ip-masq-agent" && isRunnable(f[1]) {
				cur, want = &command{line: i + 1, args: f[1:]}, nil
			}
			continue
		}
		if cur != nil {
			want = append(want, strings.TrimRight(l, " "))
		}
	}
	flush()
	return out
}

func isRunnable(cmd string) bool {
	for _, r := range runnable {
		if r == cmd {
			return true
		}
	}
	return false
}

// configOf makes the configuration an example comment names: a file, or a directory of files,
// and returns its path.
func configOf(t *testing.T, page string, above []markdown.Block, example string) (string, error) {
	dir := t.TempDir()
	if example == "defaults" {
		return filepath.Join(dir, "none"), nil // a missing file: the defaults
	}
	sources := strings.Fields(example)
	for _, s := range sources {
		name, src, named := strings.Cut(s, "=")
		if !named {
			name, src = "config", s
			if len(sources) > 1 {
				return "", fmt.Errorf("example %q: name each file of a directory, NAME=SOURCE", example)
			}
		}
		data, err := source(page, above, src)
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			return "", err
		}
		if !named {
			return filepath.Join(dir, name), nil
		}
	}
	return dir, nil
}

// source is the configuration one source names: the yaml block above, or a repository file.
func source(page string, above []markdown.Block, src string) (string, error) {
	if src == "above" {
		for i := len(above) - 1; i >= 0; i-- {
			if above[i].Lang == "yaml" {
				return configText(above[i].Body)
			}
		}
		return "", fmt.Errorf("example: no yaml block above in %s", page)
	}
	b, err := markdown.Read(src)
	if err != nil {
		return "", err
	}
	return configText(string(b))
}

// configText is a yaml document's configuration: a ConfigMap's config key, or the document.
func configText(doc string) (string, error) {
	var obj struct {
		Kind string            `json:"kind"`
		Data map[string]string `json:"data"`
	}
	if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
		return "", err
	}
	switch obj.Kind {
	case "":
		return doc, nil
	case "ConfigMap":
		c, ok := obj.Data["config"]
		if !ok {
			return "", fmt.Errorf("a ConfigMap without a config key")
		}
		return c, nil
	}
	return "", fmt.Errorf("a %s is no configuration", obj.Kind)
}

// run runs an example's command against cfg, in place of the --config it names, and returns
// what the binary prints: its output, or "ip-masq-agent: " and the error it fails with.
func run(args []string, cfg string) (string, error) {
	cmd := []string{args[0], "--config", cfg}
	if args[0] == "explain" {
		cmd = append(cmd, "--from-file") // the page's configuration, not that of an agent running here
	}
	named := config.DefaultPath
	for i := 1; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--config" && i+1 < len(args):
			named = args[i+1]
			i++
		case strings.HasPrefix(a, "--config="):
			named = strings.TrimPrefix(a, "--config=")
		default:
			cmd = append(cmd, a)
		}
	}
	var stdout, stderr bytes.Buffer
	out := ""
	switch err := cli.Run(context.Background(), cmd, &stdout, &stderr); {
	case err != nil && cli.ExitCode(err) == 2: // a mistake of the example's command line
		return "", fmt.Errorf("%w (%s)", err, strings.TrimSpace(stderr.String()))
	case err != nil:
		out = "ip-masq-agent: " + strings.ReplaceAll(err.Error(), cfg, named) // as main prints it
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(stdout.String()+out, "\n"), "\n") {
		lines = append(lines, strings.TrimRight(l, " "))
	}
	return strings.Join(lines, "\n"), nil
}

// Every configuration a page shows parses and validates: a yaml block that is a configuration
// file, or a ConfigMap's config key.
func TestConfigurationsParse(t *testing.T) {
	n := 0
	for _, page := range pages(t) {
		blocks, err := markdown.Blocks(read(t, page))
		if err != nil {
			t.Fatalf("%s: %v", page, err)
		}
		for _, b := range blocks {
			if b.Lang != "yaml" {
				continue
			}
			text, err := configText(b.Body)
			if err != nil {
				t.Errorf("%s:%d: %v", page, b.Line, err)
				continue
			}
			_, err = config.Parse([]byte(text), config.Options{EnableIPv6: true})
			switch {
			case b.Example == invalid && err == nil:
				t.Errorf("%s:%d: a configuration shown as invalid parses", page, b.Line)
			case b.Example != invalid && err != nil:
				t.Errorf("%s:%d: the configuration does not parse: %v", page, b.Line, err)
			}
			n++
		}
	}
	if n == 0 {
		t.Error("no page shows a configuration")
	}
}
