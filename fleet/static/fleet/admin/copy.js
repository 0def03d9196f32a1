// Copy buttons (the node list's short ids): the whole value goes to the clipboard.
"use strict";
document.addEventListener("click", function (event) {
  const button = event.target.closest("button.np-copy");
  if (!button) return;
  event.preventDefault();
  const value = button.dataset.copy;
  const done = function () {
    button.classList.add("np-copied");
    setTimeout(function () { button.classList.remove("np-copied"); }, 1500);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(value).then(done);
  } else {
    // Plain http on a LAN address is not a secure context: select the text for Ctrl-C instead.
    const field = document.createElement("textarea");
    field.value = value;
    document.body.appendChild(field);
    field.select();
    document.execCommand("copy");
    field.remove();
    done();
  }
});
