package docs

import (
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

// readmeLines is the most the README may grow to: the rest belongs in docs/, by task.
const readmeLines = 200

// firstScreen is how far a reader who knows Kubernetes reads before finding how to install
// the agent and how to change what keeps the pod's address.
const firstScreen = 60

// The README stays short and keeps its first screen: the two commands first, then how to
// install on a cluster and change the non-masquerade CIDRs.
func TestREADMEStaysShort(t *testing.T) {
	readme := read(t, "README.md")
	lines := strings.Split(strings.TrimRight(readme, "\n"), "\n")
	if len(lines) > readmeLines {
		t.Errorf("README.md has %d lines, more than %d: move the detail to its page in docs/ (README.md's Documentation table lists them)", len(lines), readmeLines)
	}
	blocks, err := markdown.Blocks(readme)
	if err != nil {
		t.Fatal(err)
	}
	const commands = "make demo    # as root: installs what is missing, then shows the agent's decisions\n" +
		"make test    # as root: installs what is missing, then runs every test"
	if len(blocks) == 0 || blocks[0].Body != commands {
		t.Errorf("README.md's first code block must be the two commands, exactly:\n%s", commands)
	}
	screen := strings.Join(lines[:min(firstScreen, len(lines))], "\n")
	for _, want := range []string{"kubectl apply -k deploy/base", "helm install ip-masq-agent deploy/helm/ip-masq-agent", "nonMasqueradeCIDRs:"} {
		if !strings.Contains(screen, want) {
			t.Errorf("README.md's first %d lines lack %q", firstScreen, want)
		}
	}
}
